"""Block-id planning with context parallelism: worked examples and properties."""

from __future__ import annotations

import itertools
import math

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.mappings import ParallelInfo
from ascend_dist.kv_mooncake.core.ranks import check_coverage, head_range
from ascend_dist.kv_mooncake.pull.cp_plan import cp_block_counts, cp_p_fan_in, cp_sources, plan_cp_pull

BASE = 30000


def _table(shards):
    return (
        [[BASE + w for w in s.p_world_ranks] for s in shards],
        [list(s.local_ids) for s in shards],
        [list(s.remote_ids) for s in shards],
    )


def test_worked_example_1_mla_d_dcp_p_pcp_dcp() -> None:
    p = ParallelInfo(tp_size=8, pcp_size=2, dcp_size=2, use_mla=True)
    d = ParallelInfo(tp_size=8, dcp_size=2, use_mla=True)
    shards = plan_cp_pull(
        p=p,
        d=d,
        heads=1,
        d_tp_rank=0,
        remote_block_ids=[1, 2, 3],
        local_block_ids=[1, 2, 3, 4, 5],
        prompt_len=160,
        num_external_tokens=160,
        p_block_size=16,
        d_block_size=16,
    )
    assert _table(shards) == ([[30000], [30008]], [[1, 3, 5], [2, 4]], [[1, 2, 3], [1, 2]])
    assert [s.carries_tail for s in shards] == [False, False]
    # D member 1 reads the P members p_idx 1, 3 -> [30001, 30009]; it holds the final block (q = 1).
    shards1 = plan_cp_pull(
        p=p,
        d=d,
        heads=1,
        d_tp_rank=1,
        remote_block_ids=[1, 2, 3],
        local_block_ids=[1, 2, 3, 4, 5],
        prompt_len=160,
        num_external_tokens=160,
        p_block_size=16,
        d_block_size=16,
    )
    assert [[BASE + w for w in s.p_world_ranks] for s in shards1] == [[30009], [30001]]
    assert shards1[-1].carries_tail and shards1[-1].p_cp_rank == 1


def test_worked_example_1_counts() -> None:
    assert cp_block_counts(10, 0, 4) == ([3, 3, 2, 2], 1)
    assert cp_block_counts(8, 0, 4) == ([2, 2, 2, 2], 3)
    assert cp_block_counts(10, 5, 4) == ([1, 2, 1, 1], 1)  # blocks 5..9: q1 holds 5 and 9


def test_worked_example_2_unequal_block_size_with_d_cp() -> None:
    p = ParallelInfo(tp_size=4, pcp_size=2, dcp_size=2, use_mla=True)
    d = ParallelInfo(tp_size=2, dcp_size=2, use_mla=True)
    common = dict(
        p=p,
        d=d,
        heads=1,
        remote_block_ids=[7],
        local_block_ids=[100],
        prompt_len=64,
        num_external_tokens=64,
        p_block_size=16,
        d_block_size=32,
    )
    d0 = plan_cp_pull(d_tp_rank=0, **common)  # type: ignore[arg-type]
    d1 = plan_cp_pull(d_tp_rank=1, **common)  # type: ignore[arg-type]
    assert _table(d0) == ([[30000], [30001]], [[200], [201]], [[7], [7]])
    assert _table(d1) == ([[30004], [30005]], [[200], [201]], [[7], [7]])
    assert d1[-1].carries_tail


def test_worked_example_3_prefix_and_remote_pcp() -> None:
    p = ParallelInfo(tp_size=8, pcp_size=2, use_mla=True)
    d = ParallelInfo(tp_size=8, use_mla=True)
    shards = plan_cp_pull(
        p=p,
        d=d,
        heads=1,
        d_tp_rank=3,
        remote_block_ids=[50, 51, 52],
        local_block_ids=[100, 101, 102, 103],
        prompt_len=96,
        num_external_tokens=64,
        p_block_size=16,
        d_block_size=16,
    )
    assert [list(s.local_ids) for s in shards] == [[100, 102], [101, 103]]
    assert [list(s.remote_ids) for s in shards] == [[51, 52], [51, 52]]
    assert [s.p_world_ranks for s in shards] == [(3,), (11,)]


def test_gqa_heads_stacked_from_two_p_ranks_per_cp_rank() -> None:
    """GQA H=4, P tp 4 pcp 2 -> D tp 2: each D rank stacks two P ranks of each P CP rank."""
    p, d = ParallelInfo(tp_size=4, pcp_size=2), ParallelInfo(tp_size=2)
    srcs = cp_sources(1, p, d, 4)
    assert [(s.p_rank, s.dst_head, s.n_heads) for s in srcs] == [(2, 0, 1), (3, 1, 1)]
    shards = plan_cp_pull(
        p=p,
        d=d,
        heads=4,
        d_tp_rank=1,
        remote_block_ids=[5, 6],
        local_block_ids=[10, 11, 12, 13],
        prompt_len=64,
        num_external_tokens=64,
        p_block_size=16,
        d_block_size=16,
    )
    assert [s.p_world_ranks for s in shards] == [(2, 3), (6, 7)]
    assert _table(shards)[1:] == ([[10, 12], [11, 13]], [[5, 6], [5, 6]])
    assert cp_p_fan_in(6, p=p, d=d, heads=4) == 1
    assert cp_p_fan_in(0, p=p, d=d, heads=4) == 1


@pytest.mark.parametrize(
    "case",
    [
        (ParallelInfo(8, 2, 2, use_mla=True), ParallelInfo(8, 1, 2, use_mla=True), 1, 16, 16),
        (ParallelInfo(4, 2, 2, use_mla=True), ParallelInfo(2, 1, 2, use_mla=True), 1, 16, 32),
        (ParallelInfo(4, 2, 1), ParallelInfo(2, 1, 1), 4, 16, 16),
        (ParallelInfo(8, 2, 2), ParallelInfo(4, 1, 2), 2, 16, 16),
        (ParallelInfo(4, 4, 1), ParallelInfo(4, 2, 1), 8, 16, 16),
    ],
)
@pytest.mark.parametrize(("prompt", "hit"), [(16 * 13 - 3, 0), (16 * 13, 16 * 5), (40, 32)])
def test_every_d_sub_block_and_head_written_once(
    case: tuple[ParallelInfo, ParallelInfo, int, int, int], prompt: int, hit: int
) -> None:
    """Over all D ranks: each D rank gets exactly its missing blocks, each head once, from the right P block."""
    p, d, heads, bp, bd = case
    h = 1 if p.use_mla else heads
    r = bd // bp
    nb = math.ceil(prompt / bp)
    p0 = (hit // bd) * r
    remote = [1000 + i for i in range(math.ceil(nb / p.cp_size))]  # entry i = global block i*Rcp + q
    fan_in: dict[int, int] = {}
    for d_pcp, d_tp in itertools.product(range(d.pcp_size), range(d.tp_size)):
        local_cp = d.cp_index(d_pcp, d.dcp_rank(d_tp))
        d_globals = [b for b in range(p0 // r, math.ceil(nb / r)) if b % d.cp_size == local_cp]
        local = [500 + b for b in d_globals]  # D's new blocks on this CP rank, in order
        shards = plan_cp_pull(
            p=p,
            d=d,
            heads=heads,
            d_tp_rank=d_tp,
            d_pcp_rank=d_pcp,
            remote_block_ids=remote,
            local_block_ids=local,
            prompt_len=prompt,
            num_external_tokens=prompt - p0 * bp,
            p_block_size=bp,
            d_block_size=bd,
        )
        got = set()
        for s in shards:
            _, d_heads = head_range(d_tp, d.tp_size, h)
            check_coverage(s.slices, d_heads)
            for w in s.p_world_ranks:
                fan_in[w] = fan_in.get(w, 0) + 1
                assert (w // p.tp_size) * p.dcp_size + (w % p.tp_size) % p.dcp_size == s.p_cp_rank
            for lid, rid in zip(s.local_ids, s.remote_ids, strict=True):
                g = (rid - 1000) * p.cp_size + s.p_cp_rank  # P global block
                assert lid == (500 + g // r) * r + g % r
                got.add(g)
        assert got == {g for g in range(p0, nb) if (g // r) % d.cp_size == local_cp}
        tails = [s for s in shards if s.carries_tail]
        assert not tails or shards[-1].carries_tail
    for w in range(p.world_size):
        assert cp_p_fan_in(w, p=p, d=d, heads=heads, block_ratio=r) == fan_in.get(w, 0)


def test_bad_layouts_are_typed_errors() -> None:
    kw = dict(remote_block_ids=[1], local_block_ids=[1], prompt_len=16, num_external_tokens=16, d_tp_rank=0)
    with pytest.raises(ConfigError, match="pcp_size"):  # D CP not dividing P CP
        plan_cp_pull(p=ParallelInfo(2, 3), d=ParallelInfo(2, 2), heads=2, p_block_size=16, d_block_size=16, **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="remote_block_size"):  # Bp > Bd
        plan_cp_pull(p=ParallelInfo(2, 2), d=ParallelInfo(2), heads=2, p_block_size=32, d_block_size=16, **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"decode\.tp_size"):  # P_tp < D_tp in heads
        cp_sources(0, ParallelInfo(2, 2), ParallelInfo(4), 4)
    with pytest.raises(ConfigError, match="tp_rank"):
        plan_cp_pull(
            p=ParallelInfo(2, 2),
            d=ParallelInfo(2),
            heads=2,
            p_block_size=16,
            d_block_size=16,
            **{**kw, "d_tp_rank": 5},  # type: ignore[arg-type]
        )


def test_cp_config_keys_are_parsed_and_checked() -> None:
    from ascend_dist.kv_mooncake.pull.config import PullConfig, Topology

    topo = Topology.parse("prefill", {"tp_size": 4, "pcp_size": 2, "dcp_size": 2})
    assert (topo.pcp_size, topo.dcp_size, topo.cp_size) == (2, 2, 4)
    with pytest.raises(ConfigError, match=r"prefill\.dcp_size"):
        Topology.parse("prefill", {"tp_size": 4, "dcp_size": 3})
    with pytest.raises(ConfigError, match=r"prefill\.pp_size"):
        Topology.parse("prefill", {"tp_size": 2, "pp_size": 2, "pcp_size": 2})
    cfg = PullConfig.from_kv_transfer_config(
        engine_id="D",
        kv_role="kv_consumer",
        kv_port=30000,
        extra={"prefill": {"tp_size": 2, "pcp_size": 2}, "decode": {"tp_size": 1}, "quarantine_s": 0},
    )
    assert cfg.uses_cp and cfg.quarantine_s == 0.0
    with pytest.raises(ConfigError, match="quarantine_s"):
        PullConfig.from_kv_transfer_config(
            engine_id="D",
            kv_role="kv_consumer",
            kv_port=30000,
            extra={"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "quarantine_s": -1},
        )
