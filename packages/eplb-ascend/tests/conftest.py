"""Fixtures: fork demo-worker ranks on a free loopback port (children always reaped)."""

import sys
from pathlib import Path

import pytest

from ascend_dist.eplb_ascend._demo.launch import run_ranks
from ascend_dist.eplb_ascend._demo.worker import run_rank

# --import-mode=importlib does not put this folder on sys.path; the tests import placement_strategies
# and vllm_ranks from it.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def ranks():
    """Run `world` ranks of the demo worker with a config; results sorted by rank."""

    def run(cfg, world, timeout=60.0):
        return run_ranks(run_rank, cfg, world, timeout)

    return run
