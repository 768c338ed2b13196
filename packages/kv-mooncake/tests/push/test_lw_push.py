"""Real two-process layer-wise pushes P -> D over Mooncake TCP, every byte verified on D."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_engines import SlowWriter

SINGLE = [
    pytest.param({}, id="tp1-1"),
    pytest.param({"groups": 2}, id="two-kv-groups"),
    pytest.param({"mla": True}, id="mla"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", SINGLE)
def test_push_is_byte_exact(make_lw_pair: Callable[..., Any], model: dict[str, Any]) -> None:
    pair = make_lw_pair(**model)
    assert pair.transfer("r0", 70, seed=1) == set()
    assert pair.d.verify("r0", 1) > 0
    pair.d.finish("r0")
    # D already holds the first two blocks (prefix hit): P pushes only the rest.
    assert pair.transfer("r1", 90, seed=2, computed=32) == set()
    assert pair.d.verify("r1", 2, computed_tokens=32) > 0
    pair.d.finish("r1")
    # Chunked prefill: each step pushes the blocks computed in it.
    assert pair.transfer("r2", 16 * 6 + 3, seed=3, chunks=3) == set()
    assert pair.d.verify("r2", 3) > 0
    pair.d.finish("r2")
    assert pair.p_idle() == [0]
    assert all(r.worker.receiver is not None and len(r.worker.receiver) == 0 for r in pair.d.ranks)
    assert pair.d.scheduler.tracked == 0


@pytest.mark.timeout(60)
def test_the_wire_uses_the_external_request_id(make_lw_pair: Callable[..., Any]) -> None:
    """vLLM suffixes each engine's request ids (``-`` + 8 hex): P's and D's ids of one request differ, so
    D announces the id the proxy knows, and reports completion under its own internal id."""
    pair = make_lw_pair()
    internal = "chatcmpl-7-0123abcd"
    pair.d.announce(internal, 40)
    params = pair.metaserver.take("chatcmpl-7")  # the proxy matches by the external id
    assert params["request_id"] == "chatcmpl-7"
    pair.send_prefill(params, 40, seed=4)
    pair.read_prefill()
    assert pair.d.wait_recv({internal}, timeout_s=20.0) == set()
    assert pair.d.verify(internal, 4) > 0
    pair.d.finish(internal)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "model"),
    [
        pytest.param(2, 1, {}, id="tp2-1-alltoall-gloo"),
        pytest.param(2, 2, {}, id="tp2-2"),
        # More P ranks than heads: replicas of a head sit on consecutive ranks, so the exchange
        # groups are strided ([0, 2], [1, 3]); consecutive groups paired two copies of head 0.
        pytest.param(4, 1, {"heads": 2}, id="tp4-1-replicated-heads-gloo"),
        pytest.param(4, 2, {"heads": 2}, id="tp4-2-replicated-heads-gloo"),
        pytest.param(8, 2, {"heads": 4}, id="tp8-2-replicated-heads-gloo"),
    ],
)
def test_multi_rank_push_is_byte_exact(make_lw_pair: Callable[..., Any], p_tp: int, d_tp: int, model: dict) -> None:
    """Each P rank in its own process; with P_tp > D_tp the head -> token all-to-all runs over gloo."""
    pair = make_lw_pair(p_tp, d_tp, p_procs=True, **model)
    assert pair.transfer("m0", 16 * 5 - 7, seed=11) == set()
    assert pair.d.verify("m0", 11) > 0
    pair.d.finish("m0")
    assert pair.transfer("m1", 16 * 4, seed=12, computed=16) == set()
    assert pair.d.verify("m1", 12, computed_tokens=16) > 0
    pair.d.finish("m1")
    assert pair.p_idle() == [0] * p_tp


@pytest.mark.timeout(60)
def test_layers_arrive_while_p_still_computes(make_lw_pair: Callable[..., Any]) -> None:
    """D's wait_for_layer_load(layer 0) returns long before P's forward (0.15 s per layer) ends."""
    pair = make_lw_pair(layers=6)
    pair.d.announce("o0", 64)
    params = pair.metaserver.take("o0")
    start = time.monotonic()
    pair.send_prefill(params, 64, seed=4, compute_s=0.15)
    worker = pair.d.ranks[0].worker
    worker.wait_for_layer_load(pair.d.model.layer_name(0), ["o0"])
    first = time.monotonic() - start
    (elapsed,) = pair.read_prefill()
    assert pair.d.wait_recv({"o0"}, 20.0) == set()
    assert first < elapsed - 0.3, (first, elapsed)  # layer 0 landed at least 2 layers before the end
    assert pair.d.verify("o0", 4) > 0


@pytest.mark.timeout(60)
def test_reuse_gate_keeps_freed_blocks_until_their_push_read_them() -> None:
    """P frees request A's blocks at once and request B reuses the SAME blocks while A's layers are still
    queued: B's forward waits at each layer's gate, so D receives A's bytes, not B's."""
    from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
    from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver, LwInstance
    from ascend_dist.kv_mooncake._demo.synthetic import Model
    from ascend_dist.kv_mooncake.core.engine import MooncakeEngine
    from ascend_dist.kv_mooncake.push.config import LayerwiseConfig

    port = free_port_range(1)
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}
    shape = {"layers": 4, "heads": 2, "head_dim": 16, "block_size": 16}
    ms = CollectingMetaserver()
    d_cfg = LayerwiseConfig.from_kv_transfer_config(engine_id="gD", kv_role="kv_consumer", kv_port=port, extra=extra)
    p_cfg = LayerwiseConfig.from_kv_transfer_config(engine_id="gP", kv_role="kv_producer", kv_port=port, extra=extra)
    d = LwInstance(d_cfg, Model(**shape, num_blocks=24), engine=MooncakeEngine("127.0.0.1"), metaserver=ms)
    p = LwInstance(p_cfg, Model(**shape, num_blocks=11), engine=SlowWriter(MooncakeEngine("127.0.0.1"), 0.1))
    try:
        d.announce("A", 160)
        d.announce("B", 160)
        a, b = ms.take("A"), ms.take("B")
        p.prefill(a, 160, seed=1)
        a_blocks = list(p.free[0])  # A is freed already (its pushes are still queued)
        start = time.monotonic()
        p.prefill(b, 160, seed=2)
        waited = time.monotonic() - start
        assert p.free[0] == a_blocks  # B ran in exactly A's blocks
        assert d.wait_recv({"A", "B"}, timeout_s=20.0) == set()
        assert d.verify("A", 1) > 0 and d.verify("B", 2) > 0  # without the gate A's later layers carry B's bytes
        assert waited >= 0.25  # B's forward waited for A's pushes at the gates
    finally:
        p.shutdown()
        d.shutdown()
