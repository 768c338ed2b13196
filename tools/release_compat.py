"""Each member's tests against the lowest sibling releases its ranges admit.

    python tools/release_compat.py plan [FOLDER ...]   what each member's ranges admit, per sibling
    python tools/release_compat.py run [FOLDER ...]    plan, then test every member whose ranges span more
                                                       than one release (default: every published member)

For a member, its siblings are the workspace members in its runtime closure (dependencies, no extras).
A sibling's admitted releases are its tags `<dist>-v<version>` that every range on it in that closure
contains. When the lowest admitted release is older than the workspace's version, the member's ranges span
more than one release: the member's `test` environment is synced from the lock (as `nox -s
tests-<member>`), each such sibling is replaced by its wheel built from its tag (`git archive` of the tag,
`uv build --no-sources`), the installed versions are checked to be the old ones, `uv pip check` confirms the
old wheels' own requirements hold, and the member's tests run. A member whose siblings have no earlier
release (no tag, or only the workspace's version) spans one release: that is printed and nothing runs.

The workspace's own versions are what every other session already tests. A failure here means the member
needs a newer sibling than its range admits: raise the range. Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from _workspace import ROOT, Member, normalise
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from release_plan import ReleaseRefused, git, released_versions, tag_name
from release_workspace import load_members, member_by_folder

TEST_MARKERS = "not vllm and not npu and not cuda"
BUILD_TIMEOUT_S = 600
TEST_TIMEOUT_S = 1800


class CompatError(Exception):
    """A step of the compatibility run failed (the message names it)."""


@dataclass
class SiblingRange:
    dist: str
    specifier: SpecifierSet
    workspace: Version
    admitted: list[Version] = field(default_factory=list)  # tagged releases inside the range, oldest first

    @property
    def lowest(self) -> Version | None:
        return self.admitted[0] if self.admitted else None

    @property
    def spans_more(self) -> bool:
        return self.lowest is not None and self.lowest != self.workspace


@dataclass
class CompatPlan:
    member: Member
    siblings: list[SiblingRange]

    @property
    def older(self) -> list[SiblingRange]:
        return [s for s in self.siblings if s.spans_more]

    def describe(self) -> str:
        head = f"{self.member.dist}:"
        if not self.siblings:
            return f"{head} no sibling dependencies: nothing older to test against"
        lines = [head]
        for s in self.siblings:
            admitted = ", ".join(map(str, s.admitted)) or "none tagged"
            lines.append(f"  {s.dist} {s.specifier}: workspace {s.workspace}, releases admitted: {admitted}")
        if not self.older:
            lines.append("  the range spans one release (no earlier release admitted): nothing more to run")
        else:
            lines.append("  test against: " + ", ".join(f"{s.dist} {s.lowest}" for s in self.older))
        return "\n".join(lines)


def _requirements(member: Member) -> list[Requirement]:
    return [Requirement(text) for text in member.pyproject["project"].get("dependencies", [])]


def sibling_closure(members: list[Member], member: Member) -> list[Member]:
    by_dist = {normalise(m.dist): m for m in members}
    seen: dict[str, Member] = {}
    todo = [member]
    while todo:
        current = todo.pop()
        for requirement in _requirements(current):
            name = normalise(requirement.name)
            if name in by_dist and name not in seen and name != normalise(member.dist):
                seen[name] = by_dist[name]
                todo.append(by_dist[name])
    return sorted(seen.values(), key=lambda m: m.dist)


def plan_member(root: Path, members: list[Member], member: Member) -> CompatPlan:
    """Per sibling in the closure: the intersection of the closure's ranges on it and the tags inside it."""
    siblings = sibling_closure(members, member)
    holders = [member, *siblings]
    ranges = []
    for sibling in siblings:
        specifier = SpecifierSet()
        for holder in holders:
            for requirement in _requirements(holder):
                if normalise(requirement.name) == normalise(sibling.dist):
                    specifier &= requirement.specifier
        workspace = Version(sibling.pyproject["project"]["version"])
        admitted = [v for v in released_versions(root, sibling.dist) if specifier.contains(v)]
        ranges.append(SiblingRange(sibling.dist, specifier, workspace, admitted))
    return CompatPlan(member, ranges)


def _run(cmd: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        raise CompatError(f"`{' '.join(cmd)}` ran past {timeout:.0f} s") from exc
    if done.returncode != 0:
        raise CompatError(f"`{' '.join(cmd)}` failed (exit {done.returncode}):\n{(done.stdout + done.stderr)[-4000:]}")
    return done.stdout


def build_from_tag(root: Path, dist: str, version: Version, out: Path) -> Path:
    """The wheel of `dist` built from the tree of its tag (not the workspace's), checked by file name."""
    tag = tag_name(dist, version)
    git(root, "rev-parse", "--verify", f"refs/tags/{tag}")
    tree = out / f"src-{tag}"
    tree.mkdir(parents=True)
    archive = out / f"{tag}.tar"
    git(root, "archive", "--format=tar", "-o", str(archive), tag)
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    wheels = out / f"wheel-{tag}"
    _run(["uv", "build", "--package", dist, "--no-sources", "--wheel", "-o", str(wheels)], tree, BUILD_TIMEOUT_S)
    expected = wheels / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    if not expected.is_file():
        raise CompatError(f"building {tag} wrote {sorted(p.name for p in wheels.iterdir())}, not {expected.name}")
    return expected


def installed_versions(python: Path, dists: list[str]) -> dict[str, str]:
    code = "import importlib.metadata as m, sys; print('\\n'.join(m.version(d) for d in sys.argv[1:]))"
    out = _run([str(python), "-c", code, *dists], Path.cwd(), 60).split()
    return dict(zip(dists, out, strict=True))


def swap_in(python: Path, wheels: dict[str, Path], versions: dict[str, Version]) -> None:
    """Install the old sibling wheels over an environment and prove they are what it now holds."""
    # --no-deps: sibling names must never resolve to a same-named package on an index; `uv pip check`
    # then proves the old wheels' own requirements are met by what is installed.
    _run(["uv", "pip", "install", "--quiet", "--no-deps", "--reinstall", "-p", str(python), *map(str, wheels.values())],
         Path.cwd(), BUILD_TIMEOUT_S)  # fmt: skip
    now = installed_versions(python, list(versions))
    wrong = {d: v for d, v in now.items() if Version(v) != versions[d]}
    if wrong:
        raise CompatError(f"after installing the old wheels the environment holds {wrong}, not {versions}")
    _run(["uv", "pip", "check", "-p", str(python)], Path.cwd(), 120)


def sync_test_env(root: Path, member: Member, venv: Path) -> Path:
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(venv)}
    _run(["uv", "sync", "--locked", "--no-default-groups", "--package", member.dist, "--group", "test", "--exact"],
         root, BUILD_TIMEOUT_S, env)  # fmt: skip
    return venv / "bin" / "python"


def run_member(root: Path, plan: CompatPlan, venv: Path, pytest_args: list[str]) -> str:
    """Sync the member's test env, swap in its lowest admitted siblings, run its tests; returns pytest's output."""
    python = sync_test_env(root, plan.member, venv)
    with tempfile.TemporaryDirectory(prefix="compat-") as tmp:
        wheels = {s.dist: build_from_tag(root, s.dist, s.lowest, Path(tmp)) for s in plan.older if s.lowest}
        swap_in(python, wheels, {s.dist: s.lowest for s in plan.older if s.lowest})
    tests = plan.member.folder / "tests"
    return _run([str(python), "-m", "pytest", "-p", "no:cacheprovider", str(tests), "-m", TEST_MARKERS, *pytest_args],
                root, TEST_TIMEOUT_S)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("action", choices=("plan", "run"))
    parser.add_argument("folders", nargs="*", help="member folders (default: every published member)")
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--venv-dir", type=Path, help="where the test envs go (default: <root>/.nox/compat)")
    parser.add_argument("--pytest-arg", action="append", default=[], help="passed on to pytest (repeatable)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    members = load_members(root)
    try:
        shallow = git(root, "rev-parse", "--is-shallow-repository").strip() == "true"
    except ReleaseRefused as exc:
        print(f"compat: {root} is no git checkout, so it has no release tags to test against: {exc}", file=sys.stderr)
        return 1
    if shallow:  # a shallow clone usually lacks tags: "no earlier release" would be a guess, so say so
        print("compat: WARNING: a shallow clone; release tags may be missing (git fetch --unshallow --tags)")
    chosen = [member_by_folder(members, f) for f in args.folders] or [m for m in members if not m.is_private]
    failures = 0
    for member in chosen:
        plan = plan_member(root, members, member)
        print(plan.describe(), flush=True)
        if args.action == "plan" or not plan.older:
            continue
        venv = (args.venv_dir or root / ".nox" / "compat") / member.folder.name
        try:
            print(run_member(root, plan, venv, args.pytest_arg)[-3000:], flush=True)
            print(f"compat: {member.dist} passes against " + ", ".join(f"{s.dist} {s.lowest}" for s in plan.older))
        except (CompatError, ReleaseRefused) as exc:
            failures += 1
            print(f"compat: {member.dist} FAILED: {exc}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
