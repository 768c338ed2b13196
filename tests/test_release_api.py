"""The API surface guard (tools/api_surface.py): each published member against its latest snapshot, and the
checker itself on a throwaway workspace (removals and signature changes caught, additions and bumps allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from release_fixtures import edit, make_workspace

# isort: split
# (release_fixtures puts tools/ on sys.path: the tools' modules import after it)
from api_surface import breaking_changes, check_member, latest_snapshot, write_snapshot
from api_surface_read import SurfaceError, member_surface
from release_workspace import load_members, member_by_folder

ROOT = Path(__file__).resolve().parent.parent
PUBLISHED = [m for m in load_members(ROOT) if not m.is_private]


@pytest.mark.parametrize("member", PUBLISHED, ids=lambda m: m.folder.name)
def test_member_surface_keeps_its_latest_release(member):
    """The guard itself: fails on a removal or signature change since the snapshot without the bump."""
    assert check_member(ROOT, member, load_members(ROOT)) == []


def test_surface_holds_all_names_and_the_plugins_connector_classes():
    members = load_members(ROOT)
    store = member_surface(ROOT, member_by_folder(members, "kv-store"), members)
    assert store["ascend_dist.kv_store:build_worker"]["kind"] == "function"  # a lazy TYPE_CHECKING re-export
    mooncake = member_surface(ROOT, member_by_folder(members, "kv-mooncake"), members)
    connector = mooncake["ascend_dist.kv_mooncake.pull.vllm_connector:MooncakeConnectorV1"]
    assert connector["kind"] == "class"
    assert "start_load_kv" in connector["methods"]  # inherited from our own adapter base


@pytest.fixture
def ws(tmp_path):
    root = make_workspace(tmp_path / "ws")
    members = load_members(root)
    write_snapshot(root, member_by_folder(members, "alpha"), members, "0.1.0")
    return root


def _check(root: Path) -> list[str]:
    members = load_members(root)
    return check_member(root, member_by_folder(members, "alpha"), members)


def _set_version(root: Path, version: str) -> None:
    edit(root / "packages/alpha/pyproject.toml", 'version = "0.1.0"', f'version = "{version}"')


def test_unchanged_surface_passes(ws):
    assert _check(ws) == []


def test_removed_name_fails_until_a_minor_bump(ws):
    edit(ws / "packages/alpha/src/ascend_dist/alpha/__init__.py", '["Thing", "make"]', '["Thing"]')
    problems = _check(ws)
    assert problems and "ascend_dist.alpha:make: removed" in problems[-1]
    assert "without a minor (before 1.0) bump" in problems[0]
    _set_version(ws, "0.1.1")
    assert _check(ws), "a patch bump must not allow a removal"


def test_removed_name_passes_with_a_minor_bump(ws):
    edit(ws / "packages/alpha/src/ascend_dist/alpha/__init__.py", '["Thing", "make"]', '["Thing"]')
    _set_version(ws, "0.2.0")
    assert _check(ws) == []


def test_signature_changes_are_followed_through_re_exports(ws):
    core = ws / "packages/alpha/src/ascend_dist/alpha/core.py"
    edit(core, "def make(size: int) -> Thing:", "def make(size: int, shape: int) -> Thing:")
    assert any("new parameter 'shape' has no default" in p for p in _check(ws))


def test_added_optional_parameter_and_new_name_pass(ws):
    core = ws / "packages/alpha/src/ascend_dist/alpha/core.py"
    edit(core, "def make(size: int) -> Thing:", "def make(size: int, shape: int = 1) -> Thing:")
    edit(core, '"""alpha\'s definitions."""', '"""alpha\'s definitions."""\n\n\ndef extra() -> None:\n    pass')
    edit(ws / "packages/alpha/src/ascend_dist/alpha/__init__.py", '["Thing", "make"]', '["Thing", "extra", "make"]')
    edit(ws / "packages/alpha/src/ascend_dist/alpha/__init__.py", "import Thing, make", "import Thing, extra, make")
    assert _check(ws) == []


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ('*, name: str = "x"', 'name: str = "x"', "changed from keyword_only to positional_or_keyword"),
        ('*, name: str = "x"', "*, name: str", "lost its default"),
        ('*, name: str = "x"', '*, label: str = "x"', "parameter 'name' removed"),
    ],
)
def test_method_parameter_changes_fail(ws, old, new, expected):
    edit(ws / "packages/alpha/src/ascend_dist/alpha/core.py", old, new)
    assert any(expected in p for p in _check(ws)), _check(ws)


def test_method_removed_from_a_workspace_base_fails(ws):
    edit(
        ws / "packages/alpha/src/ascend_dist/alpha/core.py",
        "    def close(self) -> None:\n",
        "    def shut(self) -> None:\n",
    )
    assert any("ascend_dist.alpha:Thing.close: removed" in p for p in _check(ws))


def test_after_1_0_only_a_major_bump_allows_breaking(ws):
    members = load_members(ws)
    _set_version(ws, "1.2.0")
    write_snapshot(ws, member_by_folder(load_members(ws), "alpha"), members, "1.2.0")
    edit(ws / "packages/alpha/src/ascend_dist/alpha/__init__.py", '["Thing", "make"]', '["Thing"]')
    edit(ws / "packages/alpha/pyproject.toml", 'version = "1.2.0"', 'version = "1.3.0"')
    assert _check(ws), "a minor bump after 1.0 must not allow a removal"
    edit(ws / "packages/alpha/pyproject.toml", 'version = "1.3.0"', 'version = "2.0.0"')
    assert _check(ws) == []


def test_name_in_all_that_is_not_defined_is_an_error(ws):
    edit(ws / "packages/alpha/src/ascend_dist/alpha/__init__.py", '["Thing", "make"]', '["Thing", "make", "ghost"]')
    members = load_members(ws)
    with pytest.raises(SurfaceError, match="does not define 'ghost'"):
        member_surface(ws, member_by_folder(members, "alpha"), members)


def test_snapshot_must_match_its_file_name(ws):
    path = ws / "packages/alpha/api/0.1.0.json"
    path.rename(ws / "packages/alpha/api/0.0.9.json")
    with pytest.raises(SurfaceError, match="does not match the file"):
        latest_snapshot(member_by_folder(load_members(ws), "alpha"))


def test_breaking_changes_sees_kind_changes():
    old = {"m:x": {"kind": "function", "params": ["a"], "returns": None}}
    assert breaking_changes(old, {"m:x": {"kind": "constant", "annotation": None}}) == [
        "m:x: was a function, is now a constant"
    ]
    assert breaking_changes(old, old) == []
