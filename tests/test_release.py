"""The release command (tools/release.py) on a throwaway workspace in a real git repository, and a dry run of
the real workspace's first release. Builds run `uv build` (hatchling from uv's cache or the index)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from release_fixtures import commit, edit, git, make_workspace, tree_state

# isort: split
# (release_fixtures puts tools/ on sys.path: the tools' modules import after it)
import release
from release_plan import ReleaseRefused

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def ws(tmp_path):
    return make_workspace(tmp_path / "ws")


def _release(root: Path, name: str, bump: str, *, dry_run: bool, out: Path):
    return release.release(root, name, bump, dry_run=dry_run, date="2026-12-03", out=out)


def _tag_first_release(root: Path) -> None:
    """As if alpha 0.1.0 had been released: heading dated, api snapshot, tag."""
    _release(root, "alpha", "0.1.0", dry_run=False, out=root / "dist")
    commit(root, "ascend-dist-alpha 0.1.0")
    git(root, "tag", "ascend-dist-alpha-v0.1.0")


def test_dry_run_builds_and_changes_nothing(ws, tmp_path, capsys):
    before = tree_state(ws)
    out = tmp_path / "out"
    plan = _release(ws, "alpha", "0.1.0", dry_run=True, out=out)
    printed = capsys.readouterr().out
    assert plan.tag == "ascend-dist-alpha-v0.1.0"
    assert "tag: ascend-dist-alpha-v0.1.0" in printed
    assert "+## 0.1.0 (2026-12-03)" in printed  # the changelog diff it would apply
    assert sorted(p.name for p in out.glob("ascend_dist_alpha-*")) == [
        "ascend_dist_alpha-0.1.0-py3-none-any.whl",
        "ascend_dist_alpha-0.1.0.tar.gz",
    ]
    assert tree_state(ws) == before


def test_release_edits_only_the_member_and_names_the_tag(ws, capsys):
    beta_before = {k: v for k, v in tree_state(ws).items() if k.startswith("packages/beta")}
    _tag_first_release(ws)
    capsys.readouterr()
    edit(ws / "packages/alpha/CHANGELOG.md", "## Unreleased\n", "## Unreleased\n\n- A fix.\n")
    commit(ws, "a fix")
    plan = _release(ws, "alpha", "patch", dry_run=False, out=ws / "dist")
    printed = capsys.readouterr().out
    assert str(plan.new) == "0.1.1"
    assert "tag: ascend-dist-alpha-v0.1.1" in printed
    assert 'version = "0.1.1"' in (ws / "packages/alpha/pyproject.toml").read_text()
    changelog = (ws / "packages/alpha/CHANGELOG.md").read_text()
    assert "## Unreleased\n\n## 0.1.1 (2026-12-03)\n\n- A fix.\n\n## 0.1.0 (2026-12-03)" in changelog
    assert (ws / "packages/alpha/api/0.1.1.json").is_file()
    with zipfile.ZipFile(ws / "dist/ascend_dist_alpha-0.1.1-py3-none-any.whl") as wheel:
        assert "Version: 0.1.1" in wheel.read("ascend_dist_alpha-0.1.1.dist-info/METADATA").decode()
    beta_after = {k: v for k, v in tree_state(ws).items() if k.startswith("packages/beta")}
    assert beta_after == beta_before


def test_bump_refused_when_a_dependent_range_excludes_it(ws):
    _tag_first_release(ws)
    edit(ws / "packages/alpha/CHANGELOG.md", "## Unreleased\n", "## Unreleased\n\n- New things.\n")
    commit(ws, "work")
    with pytest.raises(ReleaseRefused, match=r"beta/pyproject.toml requires 'ascend-dist-alpha>=0.1,<0.2'"):
        _release(ws, "alpha", "minor", dry_run=True, out=ws / "out")
    edit(ws / "packages/beta/pyproject.toml", "ascend-dist-alpha>=0.1,<0.2", "ascend-dist-alpha>=0.1,<0.3")
    assert str(_release(ws, "alpha", "minor", dry_run=True, out=ws / "out").new) == "0.2.0"


def test_breaking_api_needs_the_minor_bump(ws):
    _tag_first_release(ws)
    edit(ws / "packages/alpha/CHANGELOG.md", "## Unreleased\n", "## Unreleased\n\n- make() removed.\n")
    edit(ws / "packages/alpha/src/ascend_dist/alpha/__init__.py", '["Thing", "make"]', '["Thing"]')
    edit(ws / "packages/beta/pyproject.toml", "ascend-dist-alpha>=0.1,<0.2", "ascend-dist-alpha>=0.2,<0.3")
    commit(ws, "break")
    with pytest.raises(ReleaseRefused, match=r"ascend_dist\.alpha:make: removed"):
        _release(ws, "alpha", "patch", dry_run=True, out=ws / "out")
    assert str(_release(ws, "alpha", "minor", dry_run=True, out=ws / "out").new) == "0.2.0"


@pytest.mark.parametrize(
    ("bump", "reason"),
    [
        ("patch", "no earlier release to bump"),
        ("0.0.9", "below the pyproject's 0.1.0"),
        ("0.1.0rc1", "not a plain X.Y.Z"),
        ("bigger", "neither major, minor, patch nor a version"),
    ],
)
def test_bad_versions_refused(ws, bump, reason):
    with pytest.raises(ReleaseRefused, match=reason):
        _release(ws, "alpha", bump, dry_run=True, out=ws / "out")


def test_empty_unreleased_section_and_existing_tag_refused(ws):
    _tag_first_release(ws)
    with pytest.raises(ReleaseRefused, match="unreleased section is empty"):
        _release(ws, "alpha", "patch", dry_run=True, out=ws / "out")
    git(ws, "tag", "ascend-dist-alpha-v0.1.1")
    edit(ws / "packages/alpha/CHANGELOG.md", "## Unreleased\n", "## Unreleased\n\n- A fix.\n")
    with pytest.raises(ReleaseRefused, match=r"0\.1\.1 is not above the last release 0\.1\.1"):
        _release(ws, "alpha", "0.1.1", dry_run=True, out=ws / "out")


def test_uncommitted_member_changes_refuse_a_real_release(ws):
    edit(ws / "packages/alpha/CHANGELOG.md", "- First version.", "- First version, edited.")
    with pytest.raises(ReleaseRefused, match="uncommitted changes in packages/alpha"):
        _release(ws, "alpha", "0.1.0", dry_run=False, out=ws / "dist")


def test_real_workspace_first_release_dry_run(tmp_path, capsys):
    """What `nox -s release -- common 0.1.0 --dry-run` does: lock, build, check metadata, leave the tree alone."""
    pyproject = (ROOT / "packages/common/pyproject.toml").read_bytes()
    assert release.main(["common", "0.1.0", "--dry-run", "--out", str(tmp_path / "out")]) == 0
    assert "tag: ascend-dist-common-v0.1.0" in capsys.readouterr().out
    assert (tmp_path / "out/ascend_dist_common-0.1.0-py3-none-any.whl").is_file()
    assert (ROOT / "packages/common/pyproject.toml").read_bytes() == pyproject


def test_private_member_refused(capsys):
    assert release.main(["testing", "0.1.0", "--dry-run"]) == 1
    assert "private (never published)" in capsys.readouterr().err
