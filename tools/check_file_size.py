"""Module-size check: warn above 400 lines, fail above 800 (docs/architecture.md#checks).

Counts every tracked-or-new Python file under packages/, tests/, tools/, benchmarks/ and the noxfile.
Test modules get a larger budget (600 / 1000): table-driven cases run long.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _workspace import ROOT

SOURCE_LIMITS = (400, 800)
TEST_LIMITS = (600, 1000)
SCANNED = ("packages", "tests", "tools", "benchmarks")


def python_files() -> list[Path]:
    files = [ROOT / "noxfile.py"] if (ROOT / "noxfile.py").exists() else []
    for top in SCANNED:
        files.extend(p for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts and ".nox" not in p.parts)
    return sorted(files)


def main() -> int:
    failed = False
    for path in python_files():
        rel = path.relative_to(ROOT)
        is_test = "tests" in rel.parts
        warn, fail = TEST_LIMITS if is_test else SOURCE_LIMITS
        lines = sum(1 for _ in path.open(encoding="utf-8"))
        if lines > fail:
            print(f"check_file_size: FAIL {rel} has {lines} lines (ceiling {fail}): split it by role")
            failed = True
        elif lines > warn:
            print(f"check_file_size: warning {rel} has {lines} lines (aim for {warn} or fewer)")
    if not failed:
        print("check_file_size: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
