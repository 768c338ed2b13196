"""Shared fixtures of the cross-package tests. The helper modules next to this file (kv_cache,
peers) are imported by the tests and by the child processes they start."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# --import-mode=importlib does not put test folders on sys.path; the helpers here are plain modules.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
