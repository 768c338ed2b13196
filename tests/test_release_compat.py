"""The compatibility run (tools/release_compat.py) on a throwaway workspace in a real git repository: no earlier
release runs nothing; with a tag, the member's tests run against the sibling built from that tag, and a test
that needs the newer sibling fails there (the control)."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version
from release_fixtures import commit, edit, git, make_workspace

# isort: split
# (release_fixtures puts tools/ on sys.path: the tools' modules import after it)
import release_compat
from release_workspace import load_members, member_by_folder

ROOT = Path(__file__).resolve().parent.parent
NEW_THING = "\n\ndef new_thing() -> int:\n    return 7\n"


@pytest.fixture
def ws(tmp_path):
    return make_workspace(tmp_path / "ws")


def _advance_alpha(root: Path) -> None:
    """Tag alpha 0.1.0, then move the workspace's alpha to 0.1.1 with a new function."""
    git(root, "tag", "ascend-dist-alpha-v0.1.0")
    edit(root / "packages/alpha/pyproject.toml", 'version = "0.1.0"', 'version = "0.1.1"')
    edit(
        root / "packages/alpha/src/ascend_dist/alpha/core.py",
        "    return Thing(size)\n",
        "    return Thing(size)\n" + NEW_THING,
    )
    commit(root, "alpha 0.1.1")


def _plan(root: Path, folder: str) -> release_compat.CompatPlan:
    members = load_members(root)
    return release_compat.plan_member(root, members, member_by_folder(members, folder))


def test_no_earlier_release_runs_nothing(ws, tmp_path, capsys):
    venvs = tmp_path / "venvs"
    assert release_compat.main(["run", "--root", str(ws), "--venv-dir", str(venvs)]) == 0
    printed = capsys.readouterr().out
    assert "ascend-dist-alpha: no sibling dependencies" in printed
    assert "ascend-dist-alpha >=0.1,<0.2: workspace 0.1.0, releases admitted: none tagged" in printed.replace(
        "<0.2,>=0.1", ">=0.1,<0.2"
    )
    assert "the range spans one release" in printed
    assert not venvs.exists()


def test_only_the_workspace_version_tagged_spans_one_release(ws):
    git(ws, "tag", "ascend-dist-alpha-v0.1.0")
    plan = _plan(ws, "beta")
    assert [s.admitted for s in plan.siblings] == [[Version("0.1.0")]]
    assert plan.older == []


def test_plan_takes_the_lowest_tag_inside_the_range(ws):
    git(ws, "tag", "ascend-dist-alpha-v0.0.5")  # outside >=0.1
    _advance_alpha(ws)
    plan = _plan(ws, "beta")
    (sibling,) = plan.older
    assert (sibling.dist, sibling.lowest, sibling.workspace) == (
        "ascend-dist-alpha",
        Version("0.1.0"),
        Version("0.1.1"),
    )


def test_wheel_is_built_from_the_tag_not_the_workspace(ws, tmp_path):
    _advance_alpha(ws)
    wheel = release_compat.build_from_tag(ws, "ascend-dist-alpha", Version("0.1.0"), tmp_path / "b")
    with zipfile.ZipFile(wheel) as zf:
        core = zf.read("ascend_dist/alpha/core.py").decode()
    assert wheel.name == "ascend_dist_alpha-0.1.0-py3-none-any.whl"
    assert "new_thing" not in core
    assert "new_thing" in (ws / "packages/alpha/src/ascend_dist/alpha/core.py").read_text()


def test_member_tests_run_against_the_old_sibling(ws, tmp_path, capsys):
    _advance_alpha(ws)
    _lock(ws)
    assert release_compat.main(["run", "beta", "--root", str(ws), "--venv-dir", str(tmp_path / "v")]) == 0
    printed = capsys.readouterr().out
    assert "1 passed" in printed
    assert "compat: ascend-dist-beta passes against ascend-dist-alpha 0.1.0" in printed
    python = tmp_path / "v" / "beta" / "bin" / "python"
    assert release_compat.installed_versions(python, ["ascend-dist-alpha"]) == {"ascend-dist-alpha": "0.1.0"}


def test_a_test_needing_the_newer_sibling_fails(ws, tmp_path, capsys):
    """The control: beta now uses alpha 0.1.1's function but its range still admits 0.1.0."""
    _advance_alpha(ws)
    tests = ws / "packages/beta/tests/test_beta.py"
    tests.write_text(tests.read_text() + "\n\ndef test_new():\n    from ascend_dist.alpha.core import new_thing\n\n"
                     "    assert new_thing() == 7\n")  # fmt: skip
    commit(ws, "beta uses new_thing")
    _lock(ws)
    assert release_compat.main(["run", "beta", "--root", str(ws), "--venv-dir", str(tmp_path / "v")]) == 1
    printed = capsys.readouterr().out
    assert "compat: ascend-dist-beta FAILED" in printed
    assert "ImportError" in printed and "new_thing" in printed


def _lock(root: Path) -> None:
    subprocess.run(["uv", "lock", "--quiet"], cwd=root, check=True, timeout=300)
    commit(root, "lock")


def test_no_git_checkout_is_an_error_not_no_release(ws, capsys):
    """Without git there are no tags to read: that must not pass as 'no earlier release'."""
    subprocess.run(["rm", "-rf", str(ws / ".git")], check=True, timeout=30)
    assert release_compat.main(["run", "--root", str(ws)]) == 1
    assert "is no git checkout" in capsys.readouterr().err
