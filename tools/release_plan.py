"""What a release of one member would be, and every reason to refuse it (no file is written here).

The version rules: the last release of a member is its highest tag `<dist>-v<version>`; a release names
either a bump of that version (`major`, `minor`, `patch`) or an explicit `X.Y.Z` (the only way to cut a
member's first release). The new version must be above the last release and not below the pyproject's
version (which may already carry a pending bump, e.g. for a breaking API change).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from _workspace import Member, normalise
from api_surface import breaking_changes, bump_allows_breaking, latest_snapshot
from api_surface_read import SurfaceError, member_surface
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

BUMPS = ("major", "minor", "patch")
# `## Unreleased` or `## 0.1.0 (unreleased)`: the section a release turns into its own.
UNRELEASED = re.compile(r"^## +(?:(?P<version>\S+) +)?\(?unreleased\)? *$", re.IGNORECASE | re.MULTILINE)
NEXT_HEADING = re.compile(r"^## ", re.MULTILINE)


class ReleaseRefused(Exception):
    """The release cannot be cut; `reasons` says every why."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass
class ReleasePlan:
    member: Member
    current: Version  # the pyproject's version now
    released: Version | None  # the last tagged release, None before the first
    new: Version
    notes: list[str] = field(default_factory=list)
    changelog_section: str = ""

    @property
    def tag(self) -> str:
        return tag_name(self.member.dist, self.new)


def tag_name(dist: str, version: Version | str) -> str:
    return f"{dist}-v{version}"


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise ReleaseRefused([f"git {' '.join(args)} failed: {done.stderr.strip()}"])
    return done.stdout


def released_versions(root: Path, dist: str) -> list[Version]:
    """Every version tagged `<dist>-v<version>`, oldest first (a tag whose suffix is no version is skipped)."""
    found = []
    for tag in git(root, "tag", "--list", f"{dist}-v*").split():
        try:
            found.append(Version(tag.removeprefix(f"{dist}-v")))
        except InvalidVersion:
            continue
    return sorted(found)


def bumped(version: Version, kind: str) -> Version:
    major, minor, patch = ([*list(version.release), 0, 0])[:3]
    if kind == "major":
        return Version(f"{major + 1}.0.0")
    if kind == "minor":
        return Version(f"{major}.{minor + 1}.0")
    return Version(f"{major}.{minor}.{patch + 1}")


def choose_version(dist: str, bump: str, released: Version | None) -> Version:
    if bump in BUMPS:
        if released is None:
            raise ReleaseRefused([f"{dist} has no earlier release to bump: cut its first with an explicit X.Y.Z"])
        return bumped(released, bump)
    try:
        new = Version(bump)
    except InvalidVersion as exc:
        raise ReleaseRefused([f"{bump!r} is neither major, minor, patch nor a version"]) from exc
    if len(new.release) != 3 or new.pre or new.dev or new.post or new.local or new.epoch:
        raise ReleaseRefused([f"{bump!r} is not a plain X.Y.Z release version"])
    return new


def unreleased_section(changelog: str) -> tuple[re.Match[str], str] | None:
    """The unreleased heading and the text under it (up to the next `## `)."""
    heading = UNRELEASED.search(changelog)
    if heading is None:
        return None
    following = NEXT_HEADING.search(changelog, heading.end())
    return heading, changelog[heading.end() : following.start() if following else len(changelog)].strip()


def _changelog_reasons(plan: ReleasePlan) -> list[str]:
    path = plan.member.folder / "CHANGELOG.md"
    if not path.is_file():
        return [f"{path.name} is missing in {plan.member.folder.name}"]
    found = unreleased_section(path.read_text(encoding="utf-8"))
    if found is None:
        return [f"{plan.member.folder.name}/CHANGELOG.md has no unreleased section (`## Unreleased`) to release"]
    heading, body = found
    if not body:
        return [f"{plan.member.folder.name}/CHANGELOG.md: the unreleased section is empty"]
    named = heading.group("version")
    if named is not None and named != str(plan.new):
        return [f"{plan.member.folder.name}/CHANGELOG.md's unreleased section is for {named}, not {plan.new}"]
    plan.changelog_section = body
    return []


def dependent_reasons(members: list[Member], dist: str, new: Version) -> list[str]:
    """Every sibling requirement (dependencies and extras, private members too) whose range excludes `new`."""
    reasons = []
    for other in members:
        project = other.pyproject["project"]
        declared = list(project.get("dependencies", []))
        for requirements in project.get("optional-dependencies", {}).values():
            declared.extend(requirements)
        for text in declared:
            try:
                requirement = Requirement(text)
            except InvalidRequirement as exc:
                reasons.append(f"{other.folder.name}/pyproject.toml: unparseable requirement {text!r} ({exc})")
                continue
            if normalise(requirement.name) == normalise(dist) and not requirement.specifier.contains(new):
                reasons.append(
                    f"{other.folder.name}/pyproject.toml requires {text!r}, which excludes {new}: "
                    f"widen that range (and test {other.dist} against {new}) in this change first"
                )
    return reasons


def _api_reasons(root: Path, plan: ReleasePlan, members: list[Member]) -> list[str]:
    below = [v for v in _snapshot_versions(plan.member) if v < plan.new]
    if not below:
        plan.notes.append("API: no earlier snapshot (a first release): nothing to compare")
        return []
    previous = latest_snapshot(plan.member, below_or_at=below[-1])
    assert previous is not None  # a snapshot file exists at that version
    version, old = previous
    try:
        problems = breaking_changes(old, member_surface(root, plan.member, members))
    except SurfaceError as exc:
        return [f"API: {exc}"]
    if problems and not bump_allows_breaking(version, plan.new):
        need = "major" if version.major else "minor"
        return [f"API: {plan.new} breaks {version}'s surface and is no {need} bump: {p}" for p in problems]
    plan.notes.append(f"API: compared with {version}: {len(problems)} breaking change(s), allowed by the bump")
    return []


def _snapshot_versions(member: Member) -> list[Version]:
    return sorted(Version(p.stem) for p in (member.folder / "api").glob("*.json"))


def plan_release(root: Path, members: list[Member], member: Member, bump: str) -> ReleasePlan:
    """Check a release of `member` by `bump`; raise ReleaseRefused naming every problem."""
    if member.is_private:
        raise ReleaseRefused([f"{member.dist} is private (never published)"])
    history = released_versions(root, member.dist)
    released = history[-1] if history else None
    current = Version(member.pyproject["project"]["version"])
    plan = ReleasePlan(member, current, released, choose_version(member.dist, bump, released))
    reasons = []
    if released is not None and plan.new <= released:
        reasons.append(f"{plan.new} is not above the last release {released}")
    if plan.new < current:
        reasons.append(f"{plan.new} is below the pyproject's {current} (a pending bump: release at least that)")
    if tag_name(member.dist, plan.new) in git(root, "tag", "--list", tag_name(member.dist, plan.new)).split():
        reasons.append(f"tag {plan.tag} exists")
    reasons += _changelog_reasons(plan)
    reasons += dependent_reasons(members, member.dist, plan.new)
    reasons += _api_reasons(root, plan, members)
    if reasons:
        raise ReleaseRefused(reasons)
    return plan
