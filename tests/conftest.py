"""Shared fixtures of the cross-package tests. The helper modules next to this file (kv_cache,
peers) are imported by the tests and by the child processes they start."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Single-host tests: a config without ``host`` takes this node's address (`core.node`); pin it to
# loopback here (the tests' ports are free on 127.0.0.1, and nothing is exposed on the network).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

HERE = Path(__file__).resolve().parent
# --import-mode=importlib does not put test folders on sys.path; the helpers here are plain modules.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
