"""Hybrid planning without an engine: trimming, truncation, P/D agreement, sources."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ascend_dist.common.errors import ConfigError, LayoutError, ProtocolError
from ascend_dist.kv_mooncake.core.blocks import TensorGeom
from ascend_dist.kv_mooncake.core.messages import AgentMetadata, TensorMeta
from ascend_dist.kv_mooncake.core.ranks import select_sources
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.scheduler import PullScheduler, ReqMeta, SchedRequest
from ascend_dist.kv_mooncake.pull.sources import pull_source_ranks, source_fan_in, state_source_ranks, tp_num_need_pulls
from ascend_dist.kv_mooncake.pull.state_bytes import StateLayout
from ascend_dist.kv_mooncake.pull.task_batch import LocalCache, check_peer_rank, task_batch


def _config(role: str, **extra: Any) -> PullConfig:
    base = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, **extra}
    return PullConfig.from_kv_transfer_config(engine_id=role, kv_role=role, kv_port=40000, extra=base)


def _hybrid(role: str, windows: list[int] | None = None, **kw: Any) -> PullScheduler:
    return PullScheduler(_config(role), [16, 16, 16], windows or [0, 3, 0], state_groups=[2], **kw)


def test_spec_hybrid_trim_table_with_p_side_truncation() -> None:
    """Full attention, SWA(3) and a state group: P drops the last of 65 prompt tokens first."""
    p = _hybrid("kv_producer")
    req = SchedRequest("r", 65, {"do_remote_decode": True})
    assert p.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.prompt_len == 65 and req.kv_transfer_params == {"do_remote_decode": True}  # a pure query
    assert p.truncate_for_state(req)  # the adapter's on_new_request
    assert req.prompt_len == 64 and req.kv_transfer_params == {"do_remote_decode": True, "_p_side_truncated": True}
    assert not p.truncate_for_state(req)  # a preempted request is not truncated twice
    assert req.prompt_len == 64
    req.length_capped = True
    delay, params = p.request_finished(req, [list(range(100, 105)), [0, *range(200, 205)], list(range(300, 305))])
    assert delay and params is not None
    assert params["remote_block_ids"] == [[100, 101, 102, 103], [200, 201, 202], [300, 301, 302, 303, 304]]
    assert params["num_prompt_blocks"] == 4
    assert params["remote_window_blocks"] == [0, 3, 0] and params["remote_state_groups"] == [2]


def test_d_loads_prompt_minus_one_and_pairs_swa_tails_on_it() -> None:
    d = _hybrid("kv_consumer")
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "pr",
        "remote_host": "127.0.0.1",
        "remote_port": 40000,
        "remote_block_ids": [[1, 2, 3, 4], [2, 3, 4], [9]],
        "remote_window_blocks": [0, 3, 0],
        "remote_state_groups": [2],
    }
    req = SchedRequest("d", 65, dict(params))
    assert d.get_num_new_matched_tokens(req, 0) == (64, True)
    d.update_state_after_alloc(req, [[10, 11, 12, 13], [0, 21, 22, 23], [30]], 64)
    meta = d.build_connector_meta().requests["d"]
    assert meta.prompt_len == 64 and meta.state_groups == [2]  # what P computed, not D's 65
    from ascend_dist.kv_mooncake.pull.block_pairs import pair_group_blocks

    assert pair_group_blocks(meta, 0, 16) == ([10, 11, 12, 13], [1, 2, 3, 4])
    assert pair_group_blocks(meta, 1, 16) == ([21, 22, 23], [2, 3, 4])
    assert pair_group_blocks(meta, 2, 16) == ([30], [9])  # P's last state block into D's first
    from ascend_dist.kv_mooncake.pull.block_pairs import state_block_pair

    assert state_block_pair([0, 0, 7], [0, 0, 9]) == (7, 9)  # vLLM's null padding is skipped


@pytest.mark.parametrize(
    ("key", "value"), [("remote_window_blocks", [0, 4, 0]), ("remote_state_groups", [1])], ids=["window", "state"]
)
def test_p_and_d_disagreeing_on_groups_recompute_and_still_free_p(key: str, value: list[int]) -> None:
    d = _hybrid("kv_consumer")
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "pr",
        "remote_host": "127.0.0.1",
        "remote_port": 40000,
        "remote_block_ids": [[1], [1], [1]],
        key: value,
    }
    req = SchedRequest("d", 17, params)
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)  # D recomputes the prompt itself
    d.update_state_after_alloc(req, [[], [], []], 0)
    meta = d.build_connector_meta().requests["d"]
    assert meta.notify_only and meta.local_block_ids == [[], [], []]  # only DONE: P frees its blocks


def test_hybrid_scheduler_refusals_name_the_field() -> None:
    with pytest.raises(ConfigError, match="state_groups"):
        PullScheduler(_config("kv_producer"), [16, 16], state_groups=[2])
    with pytest.raises(ConfigError, match="window_blocks"):
        PullScheduler(_config("kv_producer"), [16, 16], [0, 3], state_groups=[1])
    cp = PullConfig.from_kv_transfer_config(
        engine_id="P",
        kv_role="kv_producer",
        kv_port=40000,
        extra={"prefill": {"tp_size": 1, "pcp_size": 2}, "decode": {"tp_size": 1}},
    )
    with pytest.raises(ConfigError, match="window_blocks"):
        PullScheduler(cp, [16, 16], [0, 3])  # sliding window + CP is refused
    PullScheduler(cp, [16, 16], state_groups=[1])  # state groups with CP are fine
    PullScheduler(cp, [16, 16])  # and several full-attention groups


@pytest.mark.parametrize(
    ("heads", "p_tp", "d_tp", "pulls"), [(8, 8, 2, 4), (4, 8, 2, 2), (4, 16, 8, 1), (32, 8, 4, 2), (8, 2, 2, 1)]
)
def test_tp_num_need_pulls_matches_the_spec_and_the_rank_choice(heads: int, p_tp: int, d_tp: int, pulls: int) -> None:
    assert tp_num_need_pulls(heads, p_tp, d_tp) == pulls
    for d in range(d_tp):
        assert len({s.p_rank for s in select_sources(d, p_tp, d_tp, heads, "req-7")}) == pulls
    assert tp_num_need_pulls(1, 16, 1, use_mla=True) == 1


def test_state_sources_and_fan_in() -> None:
    assert state_source_ranks(1, 4, 2) == [2, 3]  # d*k + j with k = P_tp / D_tp
    with pytest.raises(ConfigError, match=r"prefill\.tp_size"):
        state_source_ranks(0, 1, 2)
    # GQA H=4, P8 -> D2: attention reads a seeded replica column, state reads D rank's block of P ranks.
    for rid in ("a", "b", "c"):
        ranks = [pull_source_ranks(d, 8, 2, 4, rid, state=True) for d in range(2)]
        assert set(state_source_ranks(0, 8, 2)) <= set(ranks[0]) and set(state_source_ranks(1, 8, 2)) <= set(ranks[1])
        fan = [source_fan_in(p, 8, 2, 4, rid, state=True) for p in range(8)]
        assert sum(fan) == sum(len(r) for r in ranks) and all(f >= 1 for f in fan)  # every P rank holds state
        assert [source_fan_in(p, 8, 2, 4, rid) for p in range(8)].count(0) == 4  # attention only: one replica


def _agent(layers: dict[str, list[TensorMeta]], pp: int = 0, tp: int = 0) -> AgentMetadata:
    return AgentMetadata(
        engine_id="P", te_session="h:1", tp_rank=tp, pp_rank=pp, block_size=4, num_blocks=8, layers=layers
    )


def _meta(**kw: Any) -> ReqMeta:
    base: dict[str, Any] = {
        "request_id": "r",
        "local_block_ids": [[5], [6]],
        "remote_block_ids": [[3], [1, 2]],
        "num_computed_tokens": 0,
        "remote_request_id": "pr",
        "remote_engine_id": "P",
        "remote_host": "h",
        "remote_port": 1,
        "remote_ptp_size": 1,
        "state_groups": [1],
        "remote_block_size": 4,
    }
    return ReqMeta(**{**base, **kw})


def test_task_batch_reads_attention_and_the_state_block() -> None:
    attn = TensorGeom(0x10000, 64, 64, 4, 1, 16)
    conv, ssm = TensorGeom(0x20000, 48, 64, 1, 1, 48), TensorGeom(0x30000, 32, 32, 1, 1, 32)
    cache = LocalCache({"a": [attn], "m": [conv, ssm]}, [["a"], ["m"]], 4, 1, frozenset({1}))
    agent = _agent({"a": [TensorMeta(0x90000, 64, 64, 4, 1, 16)], "m": [TensorMeta(0xA0000, 48, 48, 1, 1, 48)] * 2})
    with pytest.raises(LayoutError, match="state tensor 1"):
        task_batch(cache, agent, _meta(), p_rank=0, d_rank=0, d_tp=1, slices=select_sources(0, 1, 1, 1, "pr"))
    agent = _agent(
        {
            "a": [TensorMeta(0x90000, 64, 64, 4, 1, 16)],
            "m": [TensorMeta(0xA0000, 48, 48, 1, 1, 48), TensorMeta(0xB0000, 32, 32, 1, 1, 32)],
        }
    )
    batch = task_batch(cache, agent, _meta(), p_rank=0, d_rank=0, d_tp=1, slices=select_sources(0, 1, 1, 1, "pr"))
    d = batch.descriptors
    assert batch.layers == ["a", "m"]
    assert d.local.tolist() == [0x10000 + 5 * 64, 0x20000 + 6 * 64, 0x30000 + 6 * 32]
    assert d.remote.tolist() == [0x90000 + 3 * 64, 0xA0000 + 2 * 48, 0xB0000 + 2 * 32]  # P's last state block
    assert np.asarray(d.lengths).tolist() == [64, 48, 32]


def test_task_batch_state_split_needs_the_layout() -> None:
    conv, ssm = TensorGeom(0x20000, 96, 96, 1, 1, 96), TensorGeom(0x30000, 64, 64, 1, 1, 64)
    cache = LocalCache({"m": [conv, ssm]}, [["m"]], 16, 1, frozenset({0}))
    p_layers = {"m": [TensorMeta(0xA0000, 48, 48, 1, 1, 48), TensorMeta(0xB0000, 32, 32, 1, 1, 32)]}
    meta = _meta(local_block_ids=[[6]], remote_block_ids=[[2]], state_groups=[0], remote_ptp_size=2)
    with pytest.raises(ConfigError, match="state_layout"):
        task_batch(cache, _agent(p_layers, tp=1), meta, p_rank=1, d_rank=0, d_tp=1, slices=[])
    layout = StateLayout.gdn(key_size=4, value_size=4, elt=2)  # W_p = 12 elements: 2 rows of 24 bytes
    cache = LocalCache({"m": [conv, ssm]}, [["m"]], 16, 1, frozenset({0}), layout)
    batch = task_batch(cache, _agent(p_layers, tp=1), meta, p_rank=1, d_rank=0, d_tp=1, slices=[])
    assert len(batch.descriptors) == 2 * 3 + 1  # Q, K, V per conv row, then the ssm slice
    assert batch.descriptors.local.tolist()[-1] == 0x30000 + 6 * 64 + 32  # P rank 1's half of D's ssm block


def test_peer_rank_check_is_pp_aware() -> None:
    check_peer_rank(_agent({}, pp=1, tp=0), port=5, pp_rank=1, tp_rank=0)
    with pytest.raises(ProtocolError, match="pp_rank=0 tp_rank=0; D expected pp_rank=1"):
        check_peer_rank(_agent({}), port=5, pp_rank=1, tp_rank=0)


def test_group_pairs_in_kernel_blocks_spec_example() -> None:
    """Kernel blocks (without compression): block 16, kernel 8 -> scale 2 on both sides."""
    kernel8 = TensorGeom(0, 8 * 16, 8 * 16, 8, 1, 16)
    cache = LocalCache({"a": [kernel8]}, [["a"]], 16, 1)
    meta = _meta(
        local_block_ids=[[1, 2]],
        remote_block_ids=[[3, 4]],
        state_groups=[],
        num_computed_tokens=8,
        remote_block_size=16,
    )
    from ascend_dist.kv_mooncake.pull.task_batch import group_pairs

    assert group_pairs(cache, meta, 0) == ([2, 3, 4], [7, 8, 9])
    # P's logical block is 32 tokens (4 kernels), D's 16 (2 kernels): D's 16-token hit skips 2 P kernels.
    meta = _meta(
        local_block_ids=[[5, 6]],
        remote_block_ids=[[3, 4]],
        state_groups=[],
        num_computed_tokens=16,
        remote_block_size=32,
    )
    assert group_pairs(cache, meta, 0) == ([10, 11, 12, 13], [14, 15, 16, 17])
    with pytest.raises(ConfigError, match="remote_block_size"):
        group_pairs(cache, _meta(remote_block_size=12, state_groups=[]), 0)


@pytest.mark.parametrize("ratio", [2, 3])
def test_state_split_with_mamba2_segments_is_byte_exact(ratio: int) -> None:
    """Mamba2's conv row ``[x | B | C]`` (sizes 8, 2, 2 per P rank): D's row holds each part of its P ranks."""
    from ascend_dist.kv_mooncake.pull.state_bytes import StateGeom, state_descriptors

    rows, seg, elt = 3, (8, 2, 2), 2
    w_p = sum(seg)
    p_conv, p_ssm = rows * w_p * elt, 40
    rem = StateGeom(0, p_conv, p_conv, p_conv, p_ssm, p_ssm)
    loc = StateGeom(0, ratio * p_conv, ratio * p_conv, ratio * p_conv, ratio * p_ssm, ratio * p_ssm)
    layout = StateLayout(seg, elt)
    assert layout.conv_rows(p_conv) == rows
    rng = np.random.default_rng(ratio)
    p_bufs = [rng.integers(0, 255, p_conv + p_ssm, dtype=np.uint8) for _ in range(ratio)]
    d_buf = np.zeros(ratio * (p_conv + p_ssm), dtype=np.uint8)
    for k, buf in enumerate(p_bufs):
        d = state_descriptors(loc, rem, 0, 0, ratio=ratio, offset=k, conv_rows=rows, elt=elt, segments=seg)
        for lo, re_, n in zip(d.local.tolist(), d.remote.tolist(), d.lengths.tolist(), strict=True):
            d_buf[lo : lo + n] = buf[re_ : re_ + n]
    conv_p = [b[:p_conv].reshape(rows, w_p, elt) for b in p_bufs]
    bounds = [(0, 8), (8, 10), (10, 12)]
    want = np.concatenate([np.concatenate([c[:, a:b] for c in conv_p], axis=1) for a, b in bounds], axis=1)
    assert np.array_equal(d_buf[: ratio * p_conv].reshape(rows, -1, elt), want)
    assert np.array_equal(d_buf[ratio * p_conv :], np.concatenate([b[p_conv:] for b in p_bufs]))
    with pytest.raises(ConfigError, match="state_layout"):
        StateLayout((4, 0), 2)
