import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError
from ascend_dist.parallel.layout import (
    ParallelLayout,
    compute_finegrained_groups,
    compute_mc2_groups,
    compute_p_tp_groups,
    get_global_rank,
)

UPSTREAM = ParallelLayout(16, tp=4, dp=2, pp=2)


def test_upstream_worked_example():
    assert compute_p_tp_groups(UPSTREAM, pd_tp_ratio=2) == [[2 * i, 2 * i + 1] for i in range(8)]
    assert compute_mc2_groups(UPSTREAM) == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_finegrained_groups_pair_real_dp_peers_when_pp_and_dp_are_both_above_one():
    # Rank 0 is (dp 0, pp 0, tp 0); its DP peer is rank 8, not the pipeline peer 4 upstream groups it with.
    groups = compute_finegrained_groups(UPSTREAM, 2)
    assert [0, 8] in groups and [0, 4] not in groups
    assert groups == [[p * 4 + t, 8 + p * 4 + t] for p in range(2) for t in range(4)]


def test_p_tp_groups_with_head_replicas_are_stride_h_apart():
    layout = ParallelLayout(8, tp=8)
    assert compute_p_tp_groups(layout, pd_tp_ratio=4, num_head_replica=2) == [[0, 2], [4, 6], [1, 3], [5, 7]]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: ParallelLayout(10, tp=4), "world_size"),
        (lambda: ParallelLayout(8, tp=0), "tp"),
        (lambda: compute_finegrained_groups(ParallelLayout(12, tp=4, dp=3), 2, name="oproj_tp_size"), "oproj_tp_size"),
        (lambda: compute_p_tp_groups(ParallelLayout(8, tp=8), pd_tp_ratio=3), "pd_tp_ratio"),
        (lambda: compute_p_tp_groups(ParallelLayout(8, tp=8), pd_tp_ratio=2, num_head_replica=4), "num_head_replica"),
    ],
)
def test_bad_layouts_name_the_field(call, field):
    with pytest.raises(ConfigError, match=field):
        call()


@pytest.mark.parametrize(
    "case",
    [
        (1, 1, 1, 0, 0, 0), (4, 1, 1, 0, 0, 0), (4, 1, 1, 0, 3, 3), (4, 1, 1, 0, 2, 2), (4, 1, 1, 1, 2, 6),
        (4, 1, 1, 1, 6, 6), (4, 1, 1, 1, 7, 7), (2, 2, 1, 1, 1, 5), (2, 2, 2, 1, 3, 11), (4, 1, 1, 1, 3, 7),
    ],
)  # fmt: skip
def test_global_rank_table(case):
    tp, pp, pcp, dp_index, rank, expected = case
    assert get_global_rank(tp=tp, pp=pp, pcp=pcp, data_parallel_index=dp_index, rank_in_group=rank) == expected


sizes = st.sampled_from([1, 2, 4])


@settings(max_examples=60, deadline=None)
@given(tp=sizes, dp=sizes, pp=sizes, pcp=sizes, ext=st.sampled_from([1, 2]))
def test_every_family_partitions_the_world(tp, dp, pp, pcp, ext):
    layout = ParallelLayout(ext * tp * dp * pp * pcp, tp=tp, dp=dp, pp=pp, pcp=pcp)
    world = list(range(layout.world_size))
    families = [compute_mc2_groups(layout), compute_finegrained_groups(layout, dp)]
    for divisor in (d for d in (1, 2, 4) if tp % d == 0):
        families.append(compute_p_tp_groups(layout, pd_tp_ratio=divisor))
    for groups in families:
        assert sorted(itertools.chain.from_iterable(groups)) == world
    # A fine-grained group is DP peers: same (external, pp, pcp, tp) coordinates, different dp.
    grid = layout.grid()
    coords = {int(grid[x, d, p, c, t]): (x, d, p, c, t) for x, d, p, c, t in itertools.product(*map(range, grid.shape))}
    for group in compute_finegrained_groups(layout, dp):
        keys = {coords[r][:1] + coords[r][2:] for r in group}
        assert len(keys) == 1 and len({coords[r][1] for r in group}) == dp
