"""The workspace's members read from any checkout root (the release tools also read old tags' trees)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from _workspace import Member


def load_members(root: Path) -> list[Member]:
    """Every `packages/*/pyproject.toml` under `root`, sorted by folder name (as `_workspace.members`)."""
    found = []
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        with pyproject.open("rb") as fh:
            found.append(Member(pyproject.parent, tomllib.load(fh)))
    return found


def member_by_folder(members: list[Member], folder: str) -> Member:
    for member in members:
        if folder in (member.folder.name, member.dist):
            return member
    raise KeyError(f"no member named {folder!r} (a folder under packages/ or a distribution name)")
