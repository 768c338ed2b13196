"""Fixtures: fork demo-worker ranks on a free loopback port (children always reaped)."""

import pytest

from ascend_dist.eplb_ascend.demo_worker import run_rank
from ascend_dist.eplb_ascend.launch import run_ranks


@pytest.fixture
def ranks():
    """Run `world` ranks of the demo worker with a config; results sorted by rank."""

    def run(cfg, world, timeout=60.0):
        return run_ranks(run_rank, cfg, world, timeout)

    return run
