"""The shape of recipes/common/: an import graph of at most 5 floors and no circle, every project import at
the top of its module (read once, seen at a glance), and nothing attached to a model or an accelerator."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

COMMON = REPO / "recipes" / "common"
# The packages of common/, bottom up: each imports only those before it ("": the modules at the bottom).
PACKAGES = ["", "data", "model", "launching", "training", "outputs"]


def module_name(path: Path, root: Path) -> str:
    """`data.tokens` for root/data/tokens.py, `data` for root/data/__init__.py."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> list[tuple[str, ast.stmt]]:
    """(the module of common imported, the statement) for each import of the project in `tree`."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[:len(here) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("common", "planner"):
            prefix = node.module.partition(".")[2] if node.module.startswith("common") else "planner"
        elif isinstance(node, ast.Import):
            found += [(alias.name.partition(".")[2], node) for alias in node.names if alias.name.startswith("common.")]
            found += [("planner", node) for alias in node.names if alias.name == "planner"]
            continue
        else:
            continue
        targets = [f"{prefix}.{alias.name}".lstrip(".") for alias in node.names]  # `from .data import tokens`
        found += [(target if target in modules else prefix, node) for target in targets]
    return [(target, node) for target, node in found if target != name]


def import_graph(folder: Path) -> tuple[dict[str, set[str]], list[str]]:
    """{module: the modules of `folder` it imports} (packages' __init__ left out: docstrings only), and the
    project imports made inside a function."""
    paths = {module_name(path, folder): path for path in sorted(folder.rglob("*.py"))}
    modules = {name for name, path in paths.items() if path.name != "__init__.py"}
    graph, inside = {}, []
    for name in sorted(modules):
        tree = ast.parse(paths[name].read_text())
        at_top = {id(node) for node in tree.body}
        guarded = {id(inner) for node in tree.body if isinstance(node, ast.If) for inner in node.body}  # `if __name__`
        imports = project_imports(tree, name, False, modules)
        graph[name] = {target for target, _ in imports if target in modules}
        where = paths[name].relative_to(folder)
        inside += [f"{where}:{node.lineno}" for _, node in imports
                   if id(node) not in at_top and id(node) not in guarded]
    return graph, inside


def package_of(module: str) -> str:
    return module.rpartition(".")[0]


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


def test_each_package_imports_only_those_below_it():
    graph, _ = import_graph(COMMON)
    assert {package_of(module) for module in graph} == set(PACKAGES)
    upward = [f"{module} -> {target}" for module, targets in graph.items() for target in targets
              if PACKAGES.index(package_of(target)) > PACKAGES.index(package_of(module))]
    assert upward == []
    packages = {package: set() for package in PACKAGES}
    for module, targets in graph.items():
        packages[package_of(module)] |= {package_of(target) for target in targets} - {package_of(module)}
    assert max(floors(packages).values()) <= 5  # the bottom modules, then at most four floors of packages


def test_no_project_import_inside_a_function():
    assert import_graph(COMMON)[1] == []


def test_nothing_is_attached_to_a_model_or_an_accelerator():
    calls = [f"{path.name}:{node.lineno}" for path in sorted(COMMON.rglob("*.py"))
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
