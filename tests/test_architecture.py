"""The shape of recipes/common/: an import graph of at most 5 floors and no circle, every project import at
the top of its module (read once, seen at a glance), and nothing attached to a model or an accelerator."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

COMMON = REPO / "recipes" / "common"
PROJECT = ("common", "planner")


def project_imports(tree: ast.Module, module: str) -> list[tuple[str, ast.stmt]]:
    """(the common module imported, the statement) for each import of the project in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [alias.name for alias in node.names]
            found += [(name.split(".")[0], node) for name in names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT:
            parts = node.module.split(".")
            found += ([(parts[1], node)] if len(parts) > 1 else [(alias.name, node) for alias in node.names])
        elif isinstance(node, ast.Import):
            found += [(alias.name.split(".")[1], node) for alias in node.names
                      if alias.name.startswith("common.")]
            found += [("planner", node) for alias in node.names if alias.name == "planner"]
    return [(name, node) for name, node in found if name != module]


def import_graph(folder: Path) -> tuple[dict[str, set[str]], list[str]]:
    """{module: the modules of `folder` it imports}, and the project imports made inside a function."""
    modules = {path.stem: ast.parse(path.read_text()) for path in sorted(folder.glob("*.py"))}
    graph, inside = {}, []
    for name, tree in modules.items():
        at_top = {id(node) for node in tree.body}
        guarded = {id(inner) for node in tree.body if isinstance(node, ast.If) for inner in node.body}  # `if __name__`
        imports = project_imports(tree, name)
        graph[name] = {target for target, _ in imports if target in modules}
        inside += [f"{name}.py:{node.lineno}" for _, node in imports
                   if id(node) not in at_top and id(node) not in guarded]
    return graph, inside


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor: 1 for a module importing none of the others, else one above the highest it imports.
    A circle raises."""
    floor: dict[str, int] = {}

    def visit(name: str, path: tuple[str, ...]) -> int:
        if name in path:
            raise AssertionError(f"an import circle: {' -> '.join(path[path.index(name):] + (name,))}")
        if name not in floor:
            floor[name] = 1 + max((visit(target, path + (name,)) for target in graph[name]), default=0)
        return floor[name]

    for name in graph:
        visit(name, ())
    return floor


def test_common_has_at_most_five_floors_and_no_circle():
    graph, _ = import_graph(COMMON)
    assert len(graph) > 20
    found = floors(graph)
    assert max(found.values()) <= 5, sorted(found.items(), key=lambda item: -item[1])[:6]
    assert found["refusal"] == 1  # the refusal at the bottom


def test_no_project_import_inside_a_function():
    assert import_graph(COMMON)[1] == []


def test_nothing_is_attached_to_a_model_or_an_accelerator():
    calls = [f"{path.name}:{node.lineno}" for path in sorted(COMMON.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"]
    assert calls == []


def test_the_measures_can_fail(tmp_path):
    """A circle, a sixth floor and an import inside a function, each found in a folder made for it."""
    chain = ["a", "b", "c", "d", "e", "f"]
    for lower, upper in zip(chain[1:], chain):
        (tmp_path / f"{upper}.py").write_text(f"from .{lower} import x\n")
    (tmp_path / "f.py").write_text("def late():\n    from .a import x\n")
    graph, inside = import_graph(tmp_path)
    assert inside == ["f.py:2"]
    try:
        floors(graph)
    except AssertionError as circle:
        assert "a -> b -> c -> d -> e -> f -> a" in str(circle)
    else:
        raise AssertionError("the circle was not found")
    (tmp_path / "f.py").write_text("x = 1\n")
    assert max(floors(import_graph(tmp_path)[0]).values()) == 6
