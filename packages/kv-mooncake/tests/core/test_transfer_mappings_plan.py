"""Layer-wise block/port planning: spec worked example, upstream equivalence, end-to-end invariants."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.kv_mooncake.core.mappings import (
    ParallelInfo,
    context_parallel_parameters_check,
    get_cp_group,
    pd_head_ratio,
    select_group_pair,
    select_group_window,
)
from ascend_dist.kv_mooncake.core.ports import PortLayout, PortScheme, RankCoord
from ascend_dist.kv_mooncake.core.transfer_mappings import (
    BlockPortMappings,
    Endpoint,
    completion_counts,
    d_block_location,
    get_local_remote_block_port_mappings,
    get_transfer_mappings,
    transfer_window,
)

BASE = 30000
BS = 16


def plan(
    p: ParallelInfo,
    d: ParallelInfo,
    pair_p: tuple[int, ...],
    pair_d: tuple[int, ...],
    *,
    num_blocks: int,
    prefix_blocks: int = 0,
    heads: int,
    hosts: tuple[str, ...] = ("d-host",),
) -> BlockPortMappings:
    return get_local_remote_block_port_mappings(
        num_blocks,
        p,
        d,
        d_hosts=hosts,
        d_base_port=BASE,
        selected_p_group=pair_p,
        selected_d_group=pair_d,
        prompt_len=num_blocks * BS,
        block_size=BS,
        remote_cache_tokens=prefix_blocks * BS,
        num_heads=heads,
    )


# --- worked example: P_tp 2 -> D_tp 1, 2 KV heads ---------------------------------------------------------------------


def test_spec_worked_example_p_tp2_d_tp1_gqa_h2_ratio2() -> None:
    ratio = pd_head_ratio(2, 1, 2)
    assert ratio == 2
    p, d = ParallelInfo(tp_size=2, pd_head_ratio=ratio), ParallelInfo(tp_size=1, pd_head_ratio=ratio)
    p_groups, d_groups = get_cp_group(2, 2, 1), get_cp_group(1, 2, 1)
    assert (p_groups, d_groups) == ([[0, 1]], [[0]])
    local_ids, remote_ids = [10, 11, 12], [40, 41, 42]
    for tp_rank in (0, 1):
        pair = select_group_pair(p_groups, d_groups, req_idx=0, head_group_rank=tp_rank)
        assert pair is not None
        maps = plan(p, d, pair.p_group, pair.d_group, num_blocks=3, heads=2)
        assert dict(maps.head_mapping) == {0: (0,), 1: (0,)}  # P0 -> D0, P1 -> D0
        tasks = get_transfer_mappings(
            maps,
            p,
            tp_rank=tp_rank,
            pcp_rank=0,
            local_block_ids=local_ids,
            remote_block_ids=remote_ids,
            transed_idx=0,
            to_trans_idx=3,
        )
        assert len(tasks) == 1
        (task,) = tasks
        assert task.endpoint == Endpoint("d-host", BASE)  # every block to D port base + 0
        assert task.local_block_ids == (10, 11, 12)
        assert task.remote_block_ids == (40, 41, 42)  # remote block = same logical index
        assert task.trans_count == 2  # D waits for two distinct senders


# --- D block index: correct formula vs upstream ----------------------------------------------------


def upstream_block_idx(logical: int, d: ParallelInfo) -> int:
    """vllm-ascend v0.11 formula, kept here only to compare against."""
    pcp = (logical // d.dcp_size) % d.pcp_size
    dcp = logical % d.dcp_size
    return (logical - (pcp * d.pcp_size + dcp)) // (d.pcp_size * d.dcp_size)


@settings(max_examples=60, deadline=None)
@given(tp_mult=st.integers(1, 4), dcp=st.sampled_from([1, 2, 4]), logical=st.integers(0, 500))
def test_block_idx_equals_upstream_when_pcp_le_1(tp_mult: int, dcp: int, logical: int) -> None:
    d = ParallelInfo(tp_size=dcp * tp_mult, pcp_size=1, dcp_size=dcp)
    assert d_block_location(logical, 0, d, ["h"], BASE).block_idx == upstream_block_idx(logical, d)


def test_block_idx_is_right_where_upstream_is_wrong_for_pcp_gt_1() -> None:
    d = ParallelInfo(tp_size=1, pcp_size=2, dcp_size=1)
    # Block 1 lives on pcp rank 1 at position 0; upstream computes (1 - 2) // 2 = -1 (the LAST block).
    assert upstream_block_idx(1, d) == -1
    where = d_block_location(1, 0, d, ["h"], BASE)
    assert (where.pcp_rank, where.block_idx, where.endpoint.port) == (1, 0, BASE + 1)
    assert [d_block_location(b, 0, d, ["h"], BASE).block_idx for b in range(6)] == [0, 0, 1, 1, 2, 2]


@settings(max_examples=60, deadline=None)
@given(
    tp_mult=st.integers(1, 2),
    pcp=st.integers(1, 3),
    dcp=st.sampled_from([1, 2]),
    n=st.integers(0, 40),
    hosts=st.integers(1, 3),
)
def test_every_logical_block_lands_on_exactly_one_d_rank(tp_mult: int, pcp: int, dcp: int, n: int, hosts: int) -> None:
    d = ParallelInfo(tp_size=dcp * tp_mult, pcp_size=pcp, dcp_size=dcp)
    host_names = [f"h{i}" for i in range(hosts)]
    layout = PortLayout(kv_port=BASE, tp_size=d.tp_size, pcp_size=pcp, scheme=PortScheme.LAYERWISE)
    for hg in range(d.num_head_groups):
        slots: dict[Endpoint, list[int]] = {}
        for logical in range(n):
            where = d_block_location(logical, hg, d, host_names, BASE)
            tp_rank = hg * dcp + where.dcp_rank
            assert where.endpoint.port == layout.port(RankCoord(tp_rank=tp_rank, pcp_rank=where.pcp_rank))
            assert d.cp_index(where.pcp_rank, where.dcp_rank) == logical % d.cp_size
            slots.setdefault(where.endpoint, []).append(where.block_idx)
        # Each D rank's positions are 0, 1, 2, ... with no gap or repeat: one home per block.
        assert all(idx == list(range(len(idx))) for idx in slots.values())
        assert sum(len(idx) for idx in slots.values()) == n


def test_hosts_split_the_d_world_evenly_in_order() -> None:
    d = ParallelInfo(tp_size=4)
    ports_hosts = [d_block_location(0, hg, d, ["a", "b"], BASE).endpoint for hg in range(4)]
    assert ports_hosts == [
        Endpoint("a", BASE),
        Endpoint("a", BASE + 1),
        Endpoint("b", BASE + 2),
        Endpoint("b", BASE + 3),
    ]


def test_d_block_location_rejects_bad_input() -> None:
    d = ParallelInfo(tp_size=2)
    with pytest.raises(ConfigError) as info:
        d_block_location(0, 0, d, [], BASE)
    assert info.value.field == "d_hosts"
    with pytest.raises(ConfigError) as info:
        d_block_location(0, 2, d, ["h"], BASE)
    assert info.value.field == "head_group"
    with pytest.raises(BlockIdError):
        d_block_location(-1, 0, d, ["h"], BASE)


# --- completion counts -------------------------------------------------------------------------------


def upstream_trans_count(p: ParallelInfo, d: ParallelInfo, cp_idx: int, num_blocks: int, prefix: int) -> int:
    """vllm-ascend v0.11 count for the D rank at CP index ``cp_idx``, for comparison."""
    if num_blocks >= p.cp_size:
        count = p.cp_size // d.cp_size
    else:
        total = prefix + num_blocks
        target = total // d.cp_size + int(cp_idx < total % d.cp_size)
        done = prefix // d.cp_size + int(cp_idx < prefix % d.cp_size)
        count = target - done
    return count * p.pd_head_ratio


@settings(max_examples=60, deadline=None)
@given(
    p_pcp=st.integers(1, 4),
    p_dcp=st.sampled_from([1, 2]),
    d_cp=st.sampled_from([(1, 1), (1, 2), (2, 1)]),
    ratio=st.integers(1, 2),
    n=st.integers(0, 20),
)
def test_completion_counts_equal_upstream_without_prefix(
    p_pcp: int, p_dcp: int, d_cp: tuple[int, int], ratio: int, n: int
) -> None:
    p = ParallelInfo(tp_size=2, pcp_size=p_pcp, dcp_size=p_dcp, pd_head_ratio=ratio)
    d = ParallelInfo(tp_size=2, pcp_size=d_cp[0], dcp_size=d_cp[1])
    assume(p.cp_size % d.cp_size == 0)
    counts = completion_counts(p, d, ["h"], BASE, num_blocks=n, prefix_blocks=0)
    assert len(counts) == d.world_size
    for world in range(d.world_size):
        pcp_rank, tp_rank = divmod(world, d.tp_size)
        cp_idx = d.cp_index(pcp_rank, d.dcp_rank(tp_rank))
        assert counts[Endpoint("h", BASE + world)] == upstream_trans_count(p, d, cp_idx, n, 0)


def test_completion_counts_with_prefix_count_actual_senders() -> None:
    # P: 4 CP ranks (pcp 4), D: no CP. 3 prompt blocks, D already holds block 0: only P CP ranks
    # 1 and 2 have anything to send. Upstream would expect 3 DONEs and wait for the timeout.
    p, d = ParallelInfo(tp_size=1, pcp_size=4, use_mla=True), ParallelInfo(tp_size=1, use_mla=True)
    counts = completion_counts(p, d, ["h"], BASE, num_blocks=3, prefix_blocks=1)
    assert counts == {Endpoint("h", BASE): 2}
    assert upstream_trans_count(p, d, 0, 3, 1) == 3


# --- transfer window ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("computed", "transed", "cached", "finished", "window"),
    [
        (40, 0, 0, False, (0, 2, False)),  # floor while the prompt is still being computed
        (40, 0, 0, True, (0, 3, True)),  # ceil once finished: the partial block goes too
        (64, 32, 0, False, (2, 4, False)),
        (64, 0, 48, False, (3, 4, False)),  # D's prefix hit is never sent
    ],
)
def test_transfer_window_table(
    computed: int, transed: int, cached: int, finished: bool, window: tuple[int, int, bool]
) -> None:
    got = transfer_window(
        ParallelInfo(tp_size=1),
        pcp_rank=0,
        dcp_rank=0,
        computed_tokens=computed,
        transed_tokens=transed,
        remote_cache_tokens=cached,
        prompt_len=100,
        block_size=BS,
        chunk_finished=finished,
    )
    assert (got.transed_idx, got.to_trans_idx, got.chunk_finished) == window


def test_transfer_window_marks_rank_finished_when_its_share_is_sent() -> None:
    # 5 prompt blocks over CP 2: rank 1 owns blocks 1 and 3; after 4 blocks it has nothing left.
    p = ParallelInfo(tp_size=2, dcp_size=2)
    common = {"transed_tokens": 0, "remote_cache_tokens": 0, "prompt_len": 5 * BS, "block_size": BS}
    rank1 = transfer_window(p, pcp_rank=0, dcp_rank=1, computed_tokens=4 * BS, chunk_finished=False, **common)
    rank0 = transfer_window(p, pcp_rank=0, dcp_rank=0, computed_tokens=4 * BS, chunk_finished=False, **common)
    assert (rank1.chunk_finished, rank0.chunk_finished) == (True, False)


# --- PCP example and errors -------------------------------------------------------------------------------


def test_mla_prefill_pcp2_to_decode_without_cp() -> None:
    p, d = ParallelInfo(tp_size=2, pcp_size=2, use_mla=True), ParallelInfo(tp_size=1, use_mla=True)
    p_groups, d_groups = get_cp_group(2, 1, 1), get_cp_group(1, 1, 1)
    assert (p_groups, d_groups) == ([[0], [1]], [[0]])
    pair = select_group_pair(p_groups, d_groups, req_idx=0, head_group_rank=0)
    assert pair is not None
    assert select_group_pair(p_groups, d_groups, req_idx=0, head_group_rank=1) is None  # replica idle
    maps = plan(p, d, pair.p_group, pair.d_group, num_blocks=6, prefix_blocks=2, heads=1)
    remote = [50, 51, 52, 53, 54, 55]
    sent = {}
    for pcp_rank in (0, 1):
        (task,) = get_transfer_mappings(
            maps,
            p,
            tp_rank=0,
            pcp_rank=pcp_rank,
            local_block_ids=[100 + 10 * pcp_rank + i for i in range(3)],
            remote_block_ids=remote,
            transed_idx=2,
            to_trans_idx=6,
        )
        sent[pcp_rank] = (task.local_block_ids, task.remote_block_ids, task.trans_count)
    # pcp 0 holds blocks 0, 2, 4 (positions 0..2) and sends 2, 4; pcp 1 holds 1, 3, 5 and sends 3, 5.
    assert sent[0] == ((101, 102), (52, 54), 2)
    assert sent[1] == ((111, 112), (53, 55), 2)


def test_transfer_mappings_reject_short_block_lists() -> None:
    p, d = ParallelInfo(tp_size=1), ParallelInfo(tp_size=1)
    maps = plan(p, d, (0,), (0,), num_blocks=3, heads=1)
    kwargs = {"tp_rank": 0, "pcp_rank": 0, "transed_idx": 0, "to_trans_idx": 3}
    with pytest.raises(BlockIdError) as info:
        get_transfer_mappings(maps, p, local_block_ids=[1, 2], remote_block_ids=[1, 2, 3], **kwargs)
    assert info.value.field == "local_block_ids"
    with pytest.raises(BlockIdError) as info:
        get_transfer_mappings(maps, p, local_block_ids=[1, 2, 3], remote_block_ids=[1], **kwargs)
    assert info.value.field == "remote_block_ids"


def test_mappings_reject_out_of_range_groups_and_ranks() -> None:
    p, d = ParallelInfo(tp_size=2), ParallelInfo(tp_size=1)
    with pytest.raises(ConfigError) as info:
        plan(p, d, (0, 2), (0,), num_blocks=1, heads=2)
    assert info.value.field == "selected_p_group"
    maps = plan(p, d, (0, 1), (0,), num_blocks=1, heads=2)
    with pytest.raises(ConfigError) as info:
        get_transfer_mappings(
            maps,
            p,
            tp_rank=2,
            pcp_rank=0,
            local_block_ids=[1],
            remote_block_ids=[1],
            transed_idx=0,
            to_trans_idx=1,
        )
    assert info.value.field == "tp_rank"


def test_mappings_are_read_only() -> None:
    maps = plan(ParallelInfo(tp_size=1), ParallelInfo(tp_size=1), (0,), (0,), num_blocks=2, heads=1)
    with pytest.raises(TypeError):
        maps.trans_counts[Endpoint("x", 1)] = 3  # type: ignore[index]


# --- end to end: every P rank of a layout, checked against what D expects ---------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> tuple[ParallelInfo, ParallelInfo, int]:
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    p_tp = draw(st.sampled_from([1, 2, 4, 8]))
    d_tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if p_tp % t == 0]))
    ratio = pd_head_ratio(p_tp, d_tp, heads, use_mla=mla)
    try:
        p = ParallelInfo(p_tp, draw(st.integers(1, 2)), draw(st.sampled_from([1, 2])), mla, ratio)
        d = ParallelInfo(d_tp, draw(st.integers(1, 2)), draw(st.sampled_from([1, 2])), mla, ratio)
        context_parallel_parameters_check(p, d, heads)
        select_group_window(get_cp_group(p_tp, heads, p.dcp_size), get_cp_group(d_tp, heads, d.dcp_size), 0)
    except ConfigError:
        assume(False)
        raise
    return p, d, heads


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), n=st.integers(0, 12), prefix=st.integers(0, 12), req_idx=st.integers(0, 3))
def test_all_p_ranks_deliver_each_block_and_d_counts_the_senders(
    layout: tuple[ParallelInfo, ParallelInfo, int], n: int, prefix: int, req_idx: int
) -> None:
    p, d, heads = layout
    prefix = min(prefix, n)
    p_groups, d_groups = (
        get_cp_group(p.tp_size, heads, p.dcp_size),
        get_cp_group(d.tp_size, heads, d.dcp_size),
    )
    remote_ids = [1000 + i for i in range(math.ceil(n / d.cp_size))]
    senders: dict[Endpoint, set[tuple[int, int]]] = {}
    received: dict[Endpoint, Counter[int]] = {}
    counts: dict[Endpoint, int] = {}
    for pcp_rank in range(p.pcp_size):
        for tp_rank in range(p.tp_size):
            pair = select_group_pair(p_groups, d_groups, req_idx=req_idx, head_group_rank=p.head_group_rank(tp_rank))
            if pair is None:
                continue
            maps = plan(p, d, pair.p_group, pair.d_group, num_blocks=n, prefix_blocks=prefix, heads=heads)
            counts = dict(maps.trans_counts)
            for task in get_transfer_mappings(
                maps,
                p,
                tp_rank=tp_rank,
                pcp_rank=pcp_rank,
                local_block_ids=list(range(n)),
                remote_block_ids=remote_ids,
                transed_idx=prefix,
                to_trans_idx=n,
            ):
                assert task.trans_count == counts[task.endpoint]
                senders.setdefault(task.endpoint, set()).add((tp_rank, pcp_rank))
                received.setdefault(task.endpoint, Counter()).update(task.remote_block_ids)
    assert counts, "at least one P rank is paired for every request"
    for world in range(d.world_size):
        endpoint = Endpoint("d-host", BASE + world)
        pcp_rank, tp_rank = divmod(world, d.tp_size)
        cp_idx = d.cp_index(pcp_rank, d.dcp_rank(tp_rank))
        mine = [remote_ids[b // d.cp_size] for b in range(prefix, n) if b % d.cp_size == cp_idx]
        # Each of this D rank's new blocks arrives once from each of the pd_head_ratio head slices ...
        assert received.get(endpoint, Counter()) == Counter({b: p.pd_head_ratio for b in mine})
        # ... and D waits for exactly as many DONEs as there are distinct senders.
        assert counts[endpoint] == len(senders.get(endpoint, set()))
