"""Cut a release of one member: `python tools/release.py MEMBER major|minor|patch|X.Y.Z [--dry-run]`.

1. Checks (`release_plan`): the new version against the member's tags, its CHANGELOG's unreleased section,
   every sibling range that names it (a range that would exclude the new version refuses the release until
   that member's range changes in the same commit), its API surface against the last snapshot.
2. Edits: the pyproject `version`, the CHANGELOG's unreleased heading becomes `## <version> (<date>)` under a
   fresh empty `## Unreleased`, the API snapshot `api/<version>.json`, and `uv.lock` (it records members'
   versions). No other member's file is touched.
3. Builds the sdist and wheel as a publisher would (`uv build --package <dist> --no-sources`) and checks
   their names and metadata carry the new version.
4. Prints the tag to create, `<dist>-v<version>`, and the commands to commit, tag and publish (it runs none).

`--dry-run` does all of it in a temporary copy of the workspace and prints the diff it would apply: the
checkout is left as it was. Exit status 1 when the release is refused (every reason printed).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

from _workspace import ROOT
from api_surface import write_snapshot
from release_plan import ReleasePlan, ReleaseRefused, git, plan_release, unreleased_section
from release_workspace import load_members, member_by_folder

# What a copy of the workspace needs to lock and build a member (not venvs, caches or old builds).
COPY_IGNORE = shutil.ignore_patterns(".venv", ".nox", "__pycache__", "*.egg-info", ".pytest_cache", "dist", "build")
COMMAND_TIMEOUT_S = 600


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise ReleaseRefused([f"`{' '.join(cmd)}` failed in {cwd}: {done.stderr.strip()[-2000:]}"])


def set_version(pyproject: Path, new: str) -> None:
    """Rewrite the `[project]` version line only; the reparsed file must differ in that one value."""
    text = pyproject.read_text(encoding="utf-8")
    before = tomllib.loads(text)
    lines = text.splitlines(keepends=True)
    table, hits = "", []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("["):
            table = stripped
        elif table == "[project]" and stripped.replace(" ", "").startswith("version="):
            hits.append(i)
    if len(hits) != 1:
        raise ReleaseRefused([f"{pyproject}: expected one `version = ` line in [project], found {len(hits)}"])
    lines[hits[0]] = f'version = "{new}"\n'
    after_text = "".join(lines)
    after = tomllib.loads(after_text)
    before["project"]["version"] = new
    if after != before:
        raise ReleaseRefused([f"{pyproject}: rewriting the version line changed more than the version"])
    pyproject.write_text(after_text, encoding="utf-8")


def release_changelog(changelog: Path, new: str, date: str) -> None:
    text = changelog.read_text(encoding="utf-8")
    found = unreleased_section(text)
    if found is None:
        raise ReleaseRefused([f"{changelog}: no unreleased section"])
    heading, _ = found
    replacement = f"## Unreleased\n\n## {new} ({date})"
    changelog.write_text(text[: heading.start()] + replacement + text[heading.end() :], encoding="utf-8")


def apply_release(root: Path, plan: ReleasePlan, date: str) -> list[Path]:
    """Write the release's edits under `root`; returns the files changed."""
    member = member_by_folder(load_members(root), plan.member.folder.name)
    new = str(plan.new)
    set_version(member.folder / "pyproject.toml", new)
    release_changelog(member.folder / "CHANGELOG.md", new, date)
    members = load_members(root)  # reread: the snapshot records the new pyproject
    snapshot = write_snapshot(root, member_by_folder(members, member.folder.name), members, new)
    changed = [member.folder / "pyproject.toml", member.folder / "CHANGELOG.md", snapshot]
    if (root / "uv.lock").is_file():
        _run(["uv", "lock"], root)
        changed.append(root / "uv.lock")
    return changed


def build(root: Path, plan: ReleasePlan, out: Path) -> list[Path]:
    """sdist and wheel of the member, checked to carry its name and new version."""
    shutil.rmtree(out, ignore_errors=True)
    _run(["uv", "build", "--package", plan.member.dist, "--no-sources", "-o", str(out)], root)
    stem = f"{plan.member.dist.replace('-', '_')}-{plan.new}"
    built = sorted(p for p in out.iterdir() if p.name.endswith((".whl", ".tar.gz")))  # uv adds a .gitignore
    expected = [out / f"{stem}-py3-none-any.whl", out / f"{stem}.tar.gz"]
    if sorted(built) != sorted(expected):
        raise ReleaseRefused([f"uv build wrote {[p.name for p in built]}, expected {[p.name for p in expected]}"])
    with zipfile.ZipFile(expected[0]) as wheel:
        metadata = wheel.read(f"{stem}.dist-info/METADATA").decode()
    if f"\nName: {plan.member.dist}\n" not in metadata or f"\nVersion: {plan.new}\n" not in metadata:
        raise ReleaseRefused([f"{expected[0].name}: METADATA does not name {plan.member.dist} {plan.new}"])
    return expected


def copy_workspace(root: Path, dest: Path) -> Path:
    copy = dest / "workspace"
    copy.mkdir()
    for name in ("pyproject.toml", "uv.lock", "README.md"):
        if (root / name).is_file():
            shutil.copy2(root / name, copy / name)
    shutil.copytree(root / "packages", copy / "packages", ignore=COPY_IGNORE)
    return copy


def show_diff(root: Path, copy: Path, changed: list[Path]) -> None:
    for path in changed:
        rel = path.relative_to(copy)
        old = (root / rel).read_text(encoding="utf-8").splitlines(keepends=True) if (root / rel).exists() else []
        new = path.read_text(encoding="utf-8").splitlines(keepends=True)
        diff = list(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}", n=1))
        print("".join(diff[:80]) + (f"... ({len(diff) - 80} more diff lines)\n" if len(diff) > 80 else ""), end="")


def report(plan: ReleasePlan, artifacts: list[Path], *, dry_run: bool) -> None:
    where = plan.member.folder.name
    print(f"release: {plan.member.dist} {plan.released or '(no earlier release)'} -> {plan.new}")
    for note in plan.notes:
        print(f"release: {note}")
    for artifact in artifacts:
        print(f"release: built {artifact.name}")
    print(f"tag: {plan.tag}")
    if dry_run:
        print("release: dry run: nothing in the checkout changed")
        return
    print("next, by hand:")
    print(f"  git add packages/{where} uv.lock && git commit -m '{plan.member.dist} {plan.new}'")
    print(f"  git tag -a {plan.tag} -m '{plan.member.dist} {plan.new}'")
    print(f"  uv publish {' '.join(str(a) for a in artifacts)}")


def release(root: Path, name: str, bump: str, *, dry_run: bool, date: str, out: Path | None) -> ReleasePlan:
    members = load_members(root)
    member = member_by_folder(members, name)
    plan = plan_release(root, members, member, bump)
    if dry_run:
        with tempfile.TemporaryDirectory(prefix="release-") as tmp:
            copy = copy_workspace(root, Path(tmp))
            changed = apply_release(copy, plan, date)
            show_diff(root, copy, changed)
            artifacts = build(copy, plan, out or Path(tmp) / "dist")
            report(plan, artifacts, dry_run=True)
        return plan
    dirty = git(root, "status", "--porcelain", "--", str(member.folder.relative_to(root)), "uv.lock")
    if dirty.strip():
        raise ReleaseRefused([f"uncommitted changes in packages/{member.folder.name} or uv.lock:\n{dirty}"])
    changed = apply_release(root, plan, date)
    print("release: changed " + ", ".join(str(p.relative_to(root)) for p in changed))
    report(plan, build(root, plan, out or root / "dist" / plan.tag), dry_run=False)
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("member", help="a folder under packages/ or a distribution name")
    parser.add_argument("bump", help="major, minor, patch, or an explicit X.Y.Z (the first release needs one)")
    parser.add_argument("--dry-run", action="store_true", help="do everything in a temporary copy; change nothing")
    parser.add_argument("--date", default=datetime.datetime.now(datetime.UTC).date().isoformat())
    parser.add_argument("--out", type=Path, help="where the sdist and wheel go (default dist/<tag>/)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the workspace checkout (default: this one)")
    args = parser.parse_args(argv)
    try:
        release(args.root.resolve(), args.member, args.bump, dry_run=args.dry_run, date=args.date, out=args.out)
    except (ReleaseRefused, KeyError) as exc:
        for reason in getattr(exc, "reasons", [str(exc)]):
            print(f"release refused: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
