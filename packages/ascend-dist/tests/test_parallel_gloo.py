"""The Ascend groups created for real over gloo in 4 processes: each group all-reduces only its members."""

from pathlib import Path

import pytest
import torch
from rank_procs import run_ranks

from ascend_dist.parallel.dist_utils import all_gather_async, split_tensor_along_first_dim

WORLD = 4
WORKER = Path(__file__).with_name("gloo_groups_worker.py")


def test_groups_over_gloo_all_reduce_within_their_members():
    reports = run_ranks(WORKER, WORLD, timeout=90)
    # Layout [dp=2, tp=2]: rank = d*2 + t. mc2 = everyone; p_tp = {0,1},{2,3}; otp = DP peers {0,2},{1,3}.
    for seen in reports:
        rank = seen["rank"]
        expected = {"mc2": 6.0, "p_tp": float(4 * (rank // 2) + 1), "otp": float(2 * (rank % 2) + 2)}
        assert seen["rounds"] == [expected, expected]
        assert seen["gathered"] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_split_tensor_along_first_dim():
    t = torch.arange(12).reshape(6, 2)
    a, _, _ = split_tensor_along_first_dim(t, 3)
    assert a.tolist() == [[0, 1], [2, 3]] and a.data_ptr() == t.data_ptr()
    assert all(x.is_contiguous() for x in split_tensor_along_first_dim(t.t(), 2, contiguous_split_chunks=True))
    with pytest.raises(ValueError, match="num_partitions"):
        split_tensor_along_first_dim(t, 4)


def test_single_rank_all_gather_returns_the_input():
    class One:
        world_size = 1
        rank_in_group = 0
        device_group = None

    t = torch.ones(3)
    out, work = all_gather_async(t, One())
    assert out is t and work is None
