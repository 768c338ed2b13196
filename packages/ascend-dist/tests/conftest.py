"""The helper modules next to the tests (rank_procs) are plain modules: --import-mode=importlib does not
put this folder on sys.path, so it is added here."""

import os
import sys
from pathlib import Path

# Single-host tests: a config without ``host`` takes this node's address (`core.node`); pin it to
# loopback here (the tests' ports are free on 127.0.0.1, and nothing is exposed on the network).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
