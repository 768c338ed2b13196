"""A throwaway uv workspace in a real git repository, shaped like ours, for the release tools' tests.

Two published members: `alpha` (no siblings) and `beta` (requires `ascend-dist-alpha` in a range), each
with a hatchling pyproject, an `ascend_dist.<name>` package, a CHANGELOG and a tests folder.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))

ROOT_PYPROJECT = """\
[project]
name = "fake-workspace"
version = "0"
requires-python = ">=3.11"

[tool.uv]
package = false

[tool.uv.workspace]
members = ["packages/*"]

[tool.uv.sources]
ascend-dist-alpha = { workspace = true }
ascend-dist-beta = { workspace = true }
"""

ALPHA_INIT = '''\
"""alpha."""

from ascend_dist.alpha.core import Thing, make

__all__ = ["Thing", "make"]
'''

ALPHA_CORE = '''\
"""alpha's definitions."""


class Base:
    def close(self) -> None:
        """Close."""


class Thing(Base):
    def __init__(self, size: int, *, name: str = "x") -> None:
        self.size = size

    def grow(self, by: int) -> int:
        return self.size + by


def make(size: int) -> Thing:
    return Thing(size)
'''

BETA_TEST = """\
from ascend_dist.alpha import make


def test_uses_alpha():
    assert make(2).grow(1) == 3
"""


def pyproject(dist: str, version: str, deps: list[str]) -> str:
    return textwrap.dedent(
        f"""\
        [build-system]
        requires = ["hatchling>=1.27"]
        build-backend = "hatchling.build"

        [project]
        name = "{dist}"
        version = "{version}"
        requires-python = ">=3.11"
        dependencies = {deps!r}

        [dependency-groups]
        test = ["pytest>=8.3"]

        [tool.uv.sources]
        ascend-dist-alpha = {{ workspace = true }}

        [tool.hatch.build.targets.wheel]
        packages = ["src/ascend_dist"]
        """
    ).replace("'", '"')


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def git(root: Path, *args: str) -> str:
    cmd = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout


def make_workspace(root: Path, *, beta_range: str = ">=0.1,<0.2") -> Path:
    """Write the workspace (alpha 0.1.0, beta 0.1.0 requiring alpha in `beta_range`) and commit it."""
    write(root / "pyproject.toml", ROOT_PYPROJECT)
    alpha = root / "packages" / "alpha"
    write(alpha / "pyproject.toml", pyproject("ascend-dist-alpha", "0.1.0", []))
    write(alpha / "src/ascend_dist/alpha/__init__.py", ALPHA_INIT)
    write(alpha / "src/ascend_dist/alpha/core.py", ALPHA_CORE)
    write(alpha / "CHANGELOG.md", "# Changelog\n\n## 0.1.0 (unreleased)\n\n- First version.\n")
    write(alpha / "tests/test_alpha.py", "def test_nothing():\n    pass\n")
    beta = root / "packages" / "beta"
    write(beta / "pyproject.toml", pyproject("ascend-dist-beta", "0.1.0", [f"ascend-dist-alpha{beta_range}"]))
    write(beta / "src/ascend_dist/beta/__init__.py", '"""beta."""\n\n__all__: list[str] = []\n')
    write(beta / "CHANGELOG.md", "# Changelog\n\n## Unreleased\n\n- First version.\n")
    write(beta / "tests/test_beta.py", BETA_TEST)
    write(root / ".gitignore", ".venv/\ndist/\n__pycache__/\n")
    git(root, "init", "-q", "-b", "main")
    commit(root, "initial")
    return root


def commit(root: Path, message: str) -> None:
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new), encoding="utf-8")


def tree_state(root: Path) -> dict[str, bytes]:
    """Every file's bytes outside .git, to prove a dry run changed nothing."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.parts
    }
