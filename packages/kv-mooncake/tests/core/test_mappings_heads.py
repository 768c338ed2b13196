"""ParallelInfo validation, head ownership, CP head groups, group pairing and the CP parameter check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.mappings import (
    ParallelInfo,
    context_parallel_parameters_check,
    get_cp_group,
    get_head_group_mapping,
    get_tp_rank_head_mapping,
    pd_head_ratio,
    round_robin_count,
    select_group_pair,
    select_group_window,
)

POW2 = st.sampled_from([1, 2, 4, 8, 16])

# --- ParallelInfo ---------------------------------------------------------------------------------


def test_parallel_info_defaults_and_derived_sizes() -> None:
    info = ParallelInfo(tp_size=8, pcp_size=2, dcp_size=2)
    assert (info.use_mla, info.pd_head_ratio) == (False, 1)
    assert info.cp_size == 4
    assert info.num_head_groups == 4
    assert info.world_size == 16
    assert (info.dcp_rank(5), info.head_group_rank(5)) == (1, 2)
    assert info.cp_index(pcp_rank=1, dcp_rank=1) == 3


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tp_size": 0}, "tp_size"),
        ({"tp_size": 4, "pcp_size": 0}, "pcp_size"),
        ({"tp_size": 4, "dcp_size": -1}, "dcp_size"),
        ({"tp_size": 4, "dcp_size": 3}, "dcp_size"),
        ({"tp_size": 4, "pd_head_ratio": 0}, "pd_head_ratio"),
        ({"tp_size": True}, "tp_size"),
        ({"tp_size": 2.0}, "tp_size"),
        ({"tp_size": 4, "use_mla": 1}, "use_mla"),
    ],
)
def test_parallel_info_rejects_bad_fields(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        ParallelInfo(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert field in str(info.value)


def test_parallel_info_is_frozen() -> None:
    info = ParallelInfo(tp_size=2)
    with pytest.raises(AttributeError):
        info.tp_size = 4  # type: ignore[misc]


# --- head ownership ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "tp", "expected"),
    [
        (4, 2, {0: [0, 1], 1: [2, 3]}),
        (4, 4, {0: [0], 1: [1], 2: [2], 3: [3]}),
        (2, 8, {0: [0], 1: [0], 2: [0], 3: [0], 4: [1], 5: [1], 6: [1], 7: [1]}),
        (1, 4, {0: [0], 1: [0], 2: [0], 3: [0]}),  # MLA: the latent head is on every rank
        (8, 1, {0: list(range(8))}),
    ],
)
def test_tp_rank_head_mapping_table(heads: int, tp: int, expected: dict[int, list[int]]) -> None:
    assert get_tp_rank_head_mapping(heads, tp) == expected


@pytest.mark.parametrize(("heads", "tp", "field"), [(6, 4, "num_heads"), (4, 6, "tp_size"), (0, 2, "num_heads")])
def test_tp_rank_head_mapping_rejects_non_divisible(heads: int, tp: int, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        get_tp_rank_head_mapping(heads, tp)
    assert info.value.field == field


@settings(max_examples=60, deadline=None)
@given(tp=POW2, per_rank=st.integers(1, 4))
def test_every_head_covered_exactly_once_when_tp_le_heads(tp: int, per_rank: int) -> None:
    heads = tp * per_rank
    mapping = get_tp_rank_head_mapping(heads, tp)
    flat = [h for r in range(tp) for h in mapping[r]]
    assert sorted(flat) == list(range(heads))
    assert all(mapping[r] == sorted(mapping[r]) and len(mapping[r]) == per_rank for r in range(tp))


@settings(max_examples=60, deadline=None)
@given(heads=POW2, replicas=st.sampled_from([2, 4, 8]))
def test_each_head_replicated_on_consecutive_ranks_when_tp_gt_heads(heads: int, replicas: int) -> None:
    tp = heads * replicas
    mapping = get_tp_rank_head_mapping(heads, tp)
    for head in range(heads):
        holders = [r for r in range(tp) if mapping[r] == [head]]
        assert holders == list(range(head * replicas, (head + 1) * replicas))


def test_head_group_mapping_unions_ranks_and_filters_selection() -> None:
    # tp 8, 4 heads, dcp 2: head group g = ranks 2g, 2g+1 = head g.
    assert get_head_group_mapping(4, 8, 4) == {0: [0], 1: [1], 2: [2], 3: [3]}
    # tp 4, 8 heads, 2 groups: each group unions two ranks' heads.
    assert get_head_group_mapping(8, 4, 2, selected=[1]) == {1: [4, 5, 6, 7]}
    with pytest.raises(ConfigError) as info:
        get_head_group_mapping(4, 8, 3)
    assert info.value.field == "num_groups"


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "heads", "mla", "ratio"),
    [(2, 1, 2, False, 2), (8, 2, 4, False, 2), (8, 4, 2, False, 1), (16, 8, 4, False, 1), (8, 1, 1, True, 1)],
)
def test_pd_head_ratio(p_tp: int, d_tp: int, heads: int, mla: bool, ratio: int) -> None:
    assert pd_head_ratio(p_tp, d_tp, heads, use_mla=mla) == ratio


def test_pd_head_ratio_rejects_p_tp_below_d_tp() -> None:
    with pytest.raises(ConfigError) as info:
        pd_head_ratio(2, 4, 8)
    assert info.value.field == "d_tp"


# --- CP head groups -------------------------------------------------------------------------------


def test_get_cp_group_docstring_example_tp8_dcp2_heads4() -> None:
    assert get_cp_group(8, 4, 2) == [[0, 1, 2, 3]]


def test_get_cp_group_docstring_example_tp8_dcp1_heads4() -> None:
    assert get_cp_group(8, 4, 1) == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize(
    ("tp", "heads", "dcp", "expected"),
    [
        (4, 8, 1, [[0, 1, 2, 3]]),  # fewer ranks than heads: one group
        (8, 1, 2, [[0], [1], [2], [3]]),  # MLA with DCP 2: each head group is a full copy
        (8, 2, 2, [[0, 2], [1, 3]]),
        (2, 2, 1, [[0, 1]]),
        (1, 2, 1, [[0]]),
    ],
)
def test_get_cp_group_table(tp: int, heads: int, dcp: int, expected: list[list[int]]) -> None:
    assert get_cp_group(tp, heads, dcp) == expected


@pytest.mark.parametrize(
    ("tp", "heads", "dcp", "field"),
    [
        (8, 4, 3, "dcp"),
        (8, 4, 4, "dcp"),
        (4, 8, 2, "dcp"),
        (6, 4, 1, "tp"),
        (4, 6, 1, "heads"),
        (0, 4, 1, "tp"),
    ],
)
def test_get_cp_group_rejects_inconsistent_sizes(tp: int, heads: int, dcp: int, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        get_cp_group(tp, heads, dcp)
    assert info.value.field == field


@settings(max_examples=80, deadline=None)
@given(heads=POW2, tp=POW2, dcp=st.sampled_from([1, 2, 4]))
def test_cp_groups_partition_head_groups_and_each_holds_all_heads(heads: int, tp: int, dcp: int) -> None:
    try:
        groups = get_cp_group(tp, heads, dcp)
    except ConfigError:
        return  # an invalid combination is rejected, which the table test covers
    flat = [g for group in groups for g in group]
    assert sorted(flat) == list(range(tp // dcp)), "groups are disjoint and cover every head group"
    head_groups = get_head_group_mapping(heads, tp, tp // dcp)
    for group in groups:
        held = sorted(h for g in group for h in head_groups[g])
        assert held == list(range(heads)), "a CP group holds each head exactly once"


# --- group pairing --------------------------------------------------------------------------------


def test_select_group_window_load_balances_by_request_index() -> None:
    p_groups = get_cp_group(8, 4, 1)  # [[0,2,4,6],[1,3,5,7]]
    d_groups = get_cp_group(4, 4, 1)  # [[0,1,2,3]]
    assert select_group_window(p_groups, d_groups, 0) == ([(0, 2, 4, 6)], [(0, 1, 2, 3)])
    assert select_group_window(p_groups, d_groups, 1) == ([(1, 3, 5, 7)], [(0, 1, 2, 3)])
    assert select_group_window(p_groups, d_groups, 2) == ([(0, 2, 4, 6)], [(0, 1, 2, 3)])


def test_select_group_pair_returns_none_for_idle_rank() -> None:
    p_groups, d_groups = get_cp_group(8, 4, 1), get_cp_group(4, 4, 1)
    pair = select_group_pair(p_groups, d_groups, req_idx=1, head_group_rank=3)
    assert pair is not None
    assert (pair.p_group, pair.d_group, pair.index) == ((1, 3, 5, 7), (0, 1, 2, 3), 0)
    assert select_group_pair(p_groups, d_groups, req_idx=1, head_group_rank=2) is None


def test_select_group_pair_pairs_by_position() -> None:
    p_groups = get_cp_group(16, 2, 1)  # 8 groups of 2
    d_groups = get_cp_group(8, 2, 2)  # 2 groups of 2
    pair = select_group_pair(p_groups, d_groups, req_idx=1, head_group_rank=3)
    assert pair is not None
    assert pair.index == 1
    assert pair.p_group == (3, 11)
    assert pair.d_group == tuple(d_groups[1])


def test_select_group_window_equal_counts_when_p_has_fewer_groups() -> None:
    p_groups, d_groups = [[0, 1, 2, 3]], [[0, 2], [1, 3]]
    with pytest.raises(ConfigError) as info:
        select_group_window(p_groups, d_groups, 0)
    assert info.value.field == "cp_groups"


# --- context_parallel_parameters_check -----------------------------------------------------------


def test_cp_check_accepts_matching_layouts() -> None:
    context_parallel_parameters_check(ParallelInfo(8, 2, 2), ParallelInfo(8, 1, 2), num_heads=8)
    context_parallel_parameters_check(ParallelInfo(8, 2, 2, use_mla=True), ParallelInfo(8), num_heads=1)


def test_cp_check_rejects_cp_sizes_that_do_not_divide() -> None:
    with pytest.raises(ConfigError) as info:
        context_parallel_parameters_check(ParallelInfo(8, 1, 2), ParallelInfo(8, 1, 4), num_heads=1)
    assert info.value.field == "pcp_size*dcp_size"
    assert "P=1*2, D=1*4" in str(info.value)


def test_cp_check_rejects_head_ratio_for_gqa_only() -> None:
    # CP sizes fit (4 % 4); ceil(8/4)=2 is not a multiple of ceil(8/2)=4.
    p, d = ParallelInfo(2, pcp_size=4), ParallelInfo(4, dcp_size=4)
    with pytest.raises(ConfigError) as info:
        context_parallel_parameters_check(p, d, num_heads=8)
    assert info.value.field == "num_heads"
    mla = ParallelInfo(2, pcp_size=4, use_mla=True)
    context_parallel_parameters_check(mla, d, num_heads=8)  # MLA skips the head rule


def test_cp_check_uses_d_dcp_not_d_tp_like_upstream() -> None:
    # Heads per D rank would be 8/4 = 2, not a multiple of P's 4 heads per rank; the upstream rule
    # compares ceil(H / D.dcp) = 8 instead, so this layout passes. Kept for compatibility.
    context_parallel_parameters_check(ParallelInfo(2), ParallelInfo(4), num_heads=8)


# --- round-robin ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "size", "index", "count"), [(10, 4, 0, 3), (10, 4, 1, 3), (10, 4, 2, 2), (0, 3, 0, 0)])
def test_round_robin_count_table(n: int, size: int, index: int, count: int) -> None:
    assert round_robin_count(n, size, index) == count


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 200), size=st.integers(1, 16))
def test_round_robin_counts_sum_to_total(n: int, size: int) -> None:
    counts = [round_robin_count(n, size, i) for i in range(size)]
    assert sum(counts) == n
    assert counts == [len(range(i, n, size)) for i in range(size)]


def test_round_robin_count_rejects_bad_index() -> None:
    with pytest.raises(ConfigError) as info:
        round_robin_count(4, 2, 2)
    assert info.value.field == "index"
