"""Ascend groups created through the pinned vLLM's real GroupCoordinator, 2 processes over gloo."""

from pathlib import Path

import pytest
from rank_procs import run_ranks

# Fresh processes each import vLLM (~15 s alone, far more on a loaded 2-core machine).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]
WORKER = Path(__file__).with_name("vllm_groups_worker.py")


def test_groups_through_vllm_init_model_parallel_group():
    seen = run_ranks(WORKER, 2, timeout=200)
    for rank, s in enumerate(seen):
        assert s == {"rank": rank, "mc2_size": 2, "p_tp_ranks": [0, 1], "sum": 1.0, "global_rank": rank,
                     "destroyed": True}  # fmt: skip
