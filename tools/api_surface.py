"""Each published member's public surface, snapshotted per release and guarded against breaking changes.

    python tools/api_surface.py check [FOLDER ...]      compare the current surface with the latest snapshot
    python tools/api_surface.py write FOLDER [--version V]   write packages/FOLDER/api/<V>.json (V: the
                                                             pyproject version); the release command calls it
    python tools/api_surface.py show FOLDER              print the current surface as JSON

What the surface holds is in `api_surface_read` (the `__all__` of each import package, the plugin's
connector classes, read from source). A change is breaking when a name disappears or changes kind, a
parameter is removed, renamed, moved or changes kind, a default is dropped, a new parameter has no
default, or a class loses a public method, property, field or attribute (or, for a dataclass or msgspec
Struct, gains a required field). Annotation text is recorded but not compared. A breaking change needs a
major bump, or a minor bump before 1.0, over the snapshot's version.

Exit status 1 when `check` finds a breaking change without that bump; every one is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from _workspace import ROOT, Member
from api_surface_read import SurfaceError, member_surface, parse_params
from packaging.version import InvalidVersion, Version
from release_workspace import load_members

SCHEMA = 1


def snapshot_dir(member: Member) -> Path:
    return member.folder / "api"


def snapshots(member: Member) -> list[tuple[Version, Path]]:
    """Every snapshot of `member`, oldest first; a file whose name is no version is an error."""
    found = []
    for path in sorted(snapshot_dir(member).glob("*.json")):
        try:
            found.append((Version(path.stem), path))
        except InvalidVersion as exc:
            raise SurfaceError(f"{path}: the file name must be a version ({exc})") from exc
    return sorted(found)


def latest_snapshot(member: Member, below_or_at: Version | None = None) -> tuple[Version, dict[str, Any]] | None:
    eligible = [(v, p) for v, p in snapshots(member) if below_or_at is None or v <= below_or_at]
    if not eligible:
        return None
    version, path = eligible[-1]
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("schema") != SCHEMA or data.get("distribution") != member.dist or data.get("version") != str(version):
        raise SurfaceError(f"{path}: schema, distribution or version does not match the file ({member.dist} {version})")
    return version, data["surface"]


def write_snapshot(root: Path, member: Member, every: list[Member], version: str) -> Path:
    surface = member_surface(root, member, every)
    path = snapshot_dir(member) / f"{Version(version)}.json"
    path.parent.mkdir(exist_ok=True)
    body = {"schema": SCHEMA, "distribution": member.dist, "version": str(Version(version)), "surface": surface}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def _param_changes(where: str, old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[str]:
    problems = []
    new_by_name = {p["name"]: p for p in new}
    old_positional = [p["name"] for p in old if p["kind"] in ("positional_only", "positional_or_keyword")]
    new_positional = [p["name"] for p in new if p["kind"] in ("positional_only", "positional_or_keyword")]
    if new_positional[: len(old_positional)] != old_positional:
        problems.append(f"{where}: positional parameters {old_positional} became {new_positional}")
    for param in old:
        now = new_by_name.get(param["name"])
        if now is None:
            problems.append(f"{where}: parameter {param['name']!r} removed")
        elif now["kind"] != param["kind"]:
            problems.append(f"{where}: parameter {param['name']!r} changed from {param['kind']} to {now['kind']}")
        elif param["default"] and not now["default"]:
            problems.append(f"{where}: parameter {param['name']!r} lost its default")
    old_names = {p["name"] for p in old}
    problems += [
        f"{where}: new parameter {p['name']!r} has no default"
        for p in new
        if p["name"] not in old_names and not p["default"]
    ]
    return problems


def _member_changes(where: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    if old["kind"] != new["kind"]:
        return [f"{where}: was a {old['kind']}, is now a {new['kind']}"]
    if old["kind"] in ("function", "property"):
        problems = _param_changes(where, parse_params(old["params"]), parse_params(new["params"]))
        if old.get("binding") != new.get("binding"):
            problems.append(f"{where}: was {old.get('binding') or 'a plain method'}, is now {new.get('binding')}")
        return problems
    if old["kind"] == "reexport" and old["of"] != new["of"]:
        return [f"{where}: re-exported {old['of']}, now {new['of']}"]
    if old["kind"] != "class":
        return []
    problems = []
    for name, method in old["methods"].items():
        if name not in new["methods"]:
            problems.append(f"{where}.{name}: removed")
        else:
            problems += _member_changes(f"{where}.{name}", method, new["methods"][name])
    problems += [f"{where}.{name}: field removed" for name in old["fields"] if name not in new["fields"]]
    problems += [f"{where}.{name}: attribute removed" for name in old["attributes"] if name not in new["attributes"]]
    if new["field_init"]:
        problems += [
            f"{where}.{name}: new field without a default"
            for name, field in new["fields"].items()
            if name not in old["fields"] and not field["default"]
        ]
    return problems


def breaking_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Every change from `old` to `new` that can break a caller (additions never do)."""
    problems = []
    for key, described in old.items():
        if key not in new:
            problems.append(f"{key}: removed")
        else:
            problems += _member_changes(key, described, new[key])
    return problems


def bump_allows_breaking(released: Version, current: Version) -> bool:
    """Semantic versioning: a major bump, or before 1.0 a minor one, may break callers."""
    if released.major == 0:
        return (current.major, current.minor) > (released.major, released.minor)
    return current.major > released.major


def check_member(root: Path, member: Member, every: list[Member]) -> list[str]:
    current_version = Version(member.pyproject["project"]["version"])
    latest = latest_snapshot(member, below_or_at=current_version)
    if latest is None:
        return [f"{member.dist}: no API snapshot at or below {current_version} (write one: api_surface.py write)"]
    version, old = latest
    problems = breaking_changes(old, member_surface(root, member, every))
    if not problems or bump_allows_breaking(version, current_version):
        return []
    need = "major" if version.major else "minor (before 1.0)"
    where = member.folder.relative_to(root)
    hint = (
        f"{member.dist} {current_version} breaks its {version} surface without a {need} bump: keep the old API, "
        f"or raise the version in {where}/pyproject.toml; if {version} was never released (no tag "
        f"{member.dist}-v{version}), rewrite its snapshot with `python tools/api_surface.py write {member.folder.name}`"
    )
    return [hint] + [f"  {p}" for p in problems]


def published(every: list[Member], folders: list[str]) -> list[Member]:
    chosen = [m for m in every if not m.is_private and (not folders or m.folder.name in folders)]
    unknown = set(folders) - {m.folder.name for m in every}
    if unknown:
        raise SurfaceError(f"no member folder named {sorted(unknown)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("action", choices=("check", "write", "show"))
    parser.add_argument("folders", nargs="*", help="member folders under packages/ (default: every published one)")
    parser.add_argument("--version", help="write: the snapshot's version (default: the pyproject version)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    args = parser.parse_args(argv)
    every = load_members(args.root)
    try:
        chosen = published(every, args.folders)
        if args.action == "show":
            for member in chosen:
                print(json.dumps(member_surface(args.root, member, every), indent=1))
            return 0
        if args.action == "write":
            for member in chosen:
                path = write_snapshot(args.root, member, every, args.version or member.pyproject["project"]["version"])
                print(f"api_surface: wrote {path.relative_to(args.root)}")
            return 0
        problems = [p for member in chosen for p in check_member(args.root, member, every)]
    except SurfaceError as exc:
        print(f"api_surface: {exc}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"api_surface: {problem}")
    if not problems:
        print(f"api_surface: ok ({len(chosen)} members)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
