"""Every relative link in README.md, docs/ and results/ points at a file that exists, and every
#anchor into a Markdown file at one of its headings: moving depth between README and docs/ must
not leave a reader, or a cited artifact, behind a dead link."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "results").glob("*/README.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors: headings lower-cased, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#+\s+(.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    dead = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(target)
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file):
            dead.append(target)
    assert not dead, f"{page.relative_to(REPO)}: dead links {dead}"


def test_the_checker_sees_links_and_anchors(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title: here\n\n[ok](#a-title-here) [gone](missing.md) [bad](#nowhere) "
                    "[web](https://example.com)\n```\n[in code](ignored.md)\n```\n")
    assert relative_links(page) == ["#a-title-here", "missing.md", "#nowhere"]
    assert heading_anchors(page) == {"a-title-here"}


def test_the_readme_reads_in_ten_minutes():
    """README.md is a user's guide of at most 20 KB: what to run and what to expect; the measurements live in
    docs/ and results/, linked from it."""
    assert len((REPO / "README.md").read_bytes()) <= 20 * 1024


# What a user runs; the measurement harnesses and their library live in scripts/measure/.
USER_TOOLS = {"build_tiny_model.py", "check_config.py", "evaluate.py", "generate.py", "inspect_data.py", "make_data.py", "merge.py",
              "plan.py", "plot.py", "slurm", "measure", "smollm2_from_pypi.py"}


def test_scripts_top_level_is_the_users_menu():
    """`ls scripts` lists the user's tools alone: a harness put back at the top level fails here (its place is
    scripts/measure/, named in its README)."""
    present = {entry.name for entry in (REPO / "scripts").iterdir()
               if entry.name != "__pycache__" and not entry.name.startswith(".")}
    assert present == USER_TOOLS, f"not a user's tool: {sorted(present - USER_TOOLS)}; missing: {sorted(USER_TOOLS - present)}"


def test_every_harness_is_named_in_the_measure_readme():
    measure = REPO / "scripts" / "measure"
    readme = (measure / "README.md").read_text()
    harnesses = {entry.name + ("/" if entry.is_dir() else "") for entry in measure.iterdir()
                 if entry.name not in ("README.md", "__pycache__") and not entry.name.startswith(".")}
    assert harnesses and not {name for name in harnesses if f"`{name}`" not in readme}
