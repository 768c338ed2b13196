"""The README's install matrix (tools/release_matrix.py): the table names the rows' commands, each row's set of
our distributions follows from the pyprojects, and the checks the `wheels` session applies catch a wrong set."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

# isort: split
import release_fixtures  # noqa: F401  (puts tools/ on sys.path)

# isort: split
from _workspace import normalise
from release_matrix import ROWS, InstallRow, row_problems, would_install
from release_workspace import load_members

ROOT = Path(__file__).resolve().parent.parent


def _closure(requirement: str) -> set[str]:
    """Our distributions a requirement brings, following dependencies and the extras asked for."""
    by_name = {normalise(m.dist): m.pyproject["project"] for m in load_members(ROOT)}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(requirement)]
    found: set[str] = set()
    while todo:
        req = todo.pop()
        name = normalise(req.name)
        key = (name, frozenset(req.extras))
        if name not in by_name or key in seen:
            continue
        seen.add(key)
        found.add(name)
        project = by_name[name]
        texts = list(project.get("dependencies", []))
        for extra in req.extras:
            texts += project.get("optional-dependencies", {}).get(extra, [])
        todo += [Requirement(t) for t in texts]
    return found


def test_readme_table_lists_every_row_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("<!-- install-matrix") : readme.index("## The two commands")]
    commands = re.findall(r"^\| [^|]+ \| `(pip install [^`]+)` \|", section, re.MULTILINE)
    assert commands == [row.command for row in ROWS]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.who)
def test_row_brings_what_the_pyprojects_say(row):
    assert _closure(row.requirement) == {normalise(d) for d in row.ours}


def test_row_problems_catch_a_missing_or_extra_distribution():
    row = InstallRow("who", "ascend-dist-weight-transfer", ("ascend-dist-common", "ascend-dist-weight-transfer"),
                     also=("torch",))  # fmt: skip
    good = {"ascend-dist-common", "ascend-dist-weight-transfer", "torch", "numpy"}
    assert row_problems(row, good) == []
    assert "missing ['ascend-dist-common']" in row_problems(row, good - {"ascend-dist-common"})[0]
    assert "extra ['ascend-dist-kv-store']" in row_problems(row, good | {"ascend-dist-kv-store"})[0]
    assert "did not bring ['torch']" in row_problems(row, good - {"torch"})[0]


def test_would_install_reads_uv_dry_run_output():
    output = (
        "Resolved 3 packages in 5ms\nWould install 3 packages\n"
        " + ascend-dist-common @ file:///tmp/x/ascend_dist_common-0.1.0-py3-none-any.whl\n"
        " + Torch_NPU==2.14.0\n + numpy==2.4.6\n"
    )
    assert would_install(output) == {"ascend-dist-common", "torch-npu", "numpy"}
