"""Reads the workspace's members from their pyproject files (stdlib only, shared by the checks)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"
META_FOLDER = "ascend-dist"
# The meta-package is the one exception to folder <-> distribution <-> import naming.
META_IMPORTS = ("ascend_dist.plugin", "ascend_dist.cli", "ascend_dist.parallel")
# PyPI rejects any upload carrying this classifier; a member with it exists for the workspace only.
PRIVATE_CLASSIFIER = "Private :: Do Not Upload"


@dataclass(frozen=True)
class Member:
    """One workspace member as its pyproject declares it."""

    folder: Path
    pyproject: dict

    @property
    def dist(self) -> str:
        return self.pyproject["project"]["name"]

    @property
    def is_meta(self) -> bool:
        return self.folder.name == META_FOLDER

    @property
    def is_private(self) -> bool:
        """A development-only member (the tests' helpers): built and tested, never published or depended on."""
        return PRIVATE_CLASSIFIER in self.pyproject["project"].get("classifiers", [])

    @property
    def expected_dist(self) -> str:
        return META_FOLDER if self.is_meta else f"ascend-dist-{self.folder.name}"

    @property
    def imports(self) -> tuple[str, ...]:
        """The import packages this member owns under the ascend_dist namespace."""
        if self.is_meta:
            return META_IMPORTS
        return ("ascend_dist." + self.folder.name.replace("-", "_"),)

    def requirement_names(self, *, extras: bool) -> set[str]:
        """Normalised names of the distributions this member declares."""
        reqs = list(self.pyproject["project"].get("dependencies", []))
        if extras:
            for group in self.pyproject["project"].get("optional-dependencies", {}).values():
                reqs.extend(group)
        return {normalise(requirement_name(r)) for r in reqs}


def requirement_name(requirement: str) -> str:
    """The distribution name at the start of a PEP 508 requirement string."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not match:
        raise ValueError(f"unparseable requirement {requirement!r}")
    return match.group(1)


def normalise(name: str) -> str:
    """PEP 503 name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


def members() -> list[Member]:
    """Every folder under packages/ that has a pyproject.toml, sorted by folder name."""
    found = []
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        with pyproject.open("rb") as fh:
            found.append(Member(pyproject.parent, tomllib.load(fh)))
    return found


def dist_of_import(module: str, by_import: dict[str, str]) -> str | None:
    """The member distribution owning `module` (longest matching import prefix), if any."""
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        owner = by_import.get(".".join(parts[:n]))
        if owner:
            return owner
    return None
