"""P's forward in vLLM's order: the layer's KV is written BEFORE the connector's ``wait_for_layer_load``.

vLLM (0.33) writes a layer's KV cache in ``unified_kv_cache_update`` and only then enters
``unified_attention_with_output``, whose wrapper calls ``wait_for_layer_load`` (the reuse gate)
before attention and ``save_kv_layer`` after it. A gate waited on at ``wait_for_layer_load`` is
therefore too late: when request A's pushes lag behind the forward and request B runs in A's freed
blocks, B's cache update overwrites A's blocks before A's queued layers are read, and D silently
receives B's bytes for A's later layers (the engine tier's wrong tokens, TP 2 -> 1, on a loaded
machine). P must wait for every queued push before a step's forward starts (`start_load_kv`).

Real Mooncake TCP engines and ZMQ; the lag is a slow `Writer` (our own Protocol) injected through
the constructor, so the race happens every run instead of under load only.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from fault_engines import SlowWriter

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver, LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.scheduler import Scheduled


class _NoExchange:
    """The `AllToAll` of head-major blocks: never called (each P rank writes its own heads' slice)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def exchange(self, send: Any) -> Any:
        raise AssertionError("head-major blocks need no all-to-all")


def _vllm_order_prefill(p: LwInstance, params: dict[str, Any], prompt_len: int, seed: int) -> None:
    """One-step prefill as vLLM runs it: bind/start, then per layer cache update -> gate -> attention -> save."""
    rid = str(params["request_id"])
    req = p.requests[rid] = SchedRequest(rid, prompt_len, {**params, "do_remote_decode": True})
    ids = p._alloc(rid, prompt_len)
    p.scheduler.update_state_after_alloc(req, ids, 0)
    p.step({rid: Scheduled(0, prompt_len)})
    for i in range(p.model.layers):
        name = p.model.layer_name(i)
        p._write_layer(rid, seed, i)  # unified_kv_cache_update
        for r in p.ranks:
            r.worker.wait_for_layer_load(name)  # maybe_transfer_kv_layer, on entry
        for r in p.ranks:
            r.worker.save_kv_layer(name)  # maybe_transfer_kv_layer, on exit
    p.finish(rid)  # P frees the request's blocks at once


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("p_tp", "layout"),
    [pytest.param(2, "LBHNC", id="tp2-1-head-major"), pytest.param(1, "", id="tp1-1")],
)
def test_next_request_in_freed_blocks_never_reaches_d_as_the_previous_one(p_tp: int, layout: str) -> None:
    """A's layers are still queued when B, in A's freed blocks, writes its KV: D must get A's bytes for A."""
    port = free_port_range(1)
    extra = {"prefill": {"tp_size": p_tp}, "decode": {"tp_size": 1}}
    shape: dict[str, Any] = {"layers": 2, "heads": 2, "head_dim": 16, "block_size": 16}
    if layout:
        shape["layout"] = layout
    ms = CollectingMetaserver()
    d_cfg = LayerwiseConfig.from_kv_transfer_config(engine_id="oD", kv_role="kv_consumer", kv_port=port, extra=extra)
    p_cfg = LayerwiseConfig.from_kv_transfer_config(engine_id="oP", kv_role="kv_producer", kv_port=port, extra=extra)
    d = LwInstance(d_cfg, Model(**shape, num_blocks=24), engine=MooncakeEngine("127.0.0.1"), metaserver=ms)
    p = LwInstance(
        p_cfg,
        Model(**shape, num_blocks=11),
        engine=SlowWriter(MooncakeEngine("127.0.0.1"), 0.1),
        all_to_all=_NoExchange(p_tp) if p_tp > 1 else None,
    )
    try:
        d.announce("A", 160)
        d.announce("B", 160)
        a, b = ms.take("A"), ms.take("B")
        _vllm_order_prefill(p, a, 160, seed=1)
        a_blocks = list(p.free[0])  # A is freed already (its pushes are still queued)
        start = time.monotonic()
        _vllm_order_prefill(p, b, 160, seed=2)
        waited = time.monotonic() - start
        assert p.free[0] == a_blocks  # B ran in exactly A's blocks
        assert d.wait_recv({"A", "B"}, timeout_s=20.0) == set()
        assert d.verify("B", 2) > 0
        assert d.verify("A", 1) > 0  # fails when B's cache update overwrote A's blocks before their push
        assert waited >= 0.15  # B's step waited for A's two queued layers (0.1 s each) before its forward
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.timeout(60)
def test_p_arriving_after_d_gave_up_never_writes_into_the_recomputed_blocks() -> None:
    """D's first-layer deadline passes before P starts (P's first forward slow under load): vLLM recomputes
    the request in the same blocks, so P's late push must not land there (it did: wrong tokens on D)."""
    port = free_port_range(1)
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}
    shape: dict[str, Any] = {"layers": 2, "heads": 2, "head_dim": 16, "block_size": 16}
    ms = CollectingMetaserver()
    d_cfg = LayerwiseConfig.from_kv_transfer_config(
        engine_id="lD", kv_role="kv_consumer", kv_port=port, extra={**extra, "first_layer_timeout_s": 0.3}
    )
    p_cfg = LayerwiseConfig.from_kv_transfer_config(engine_id="lP", kv_role="kv_producer", kv_port=port, extra=extra)
    d = LwInstance(d_cfg, Model(**shape, num_blocks=24), engine=MooncakeEngine("127.0.0.1"), metaserver=ms)
    p = LwInstance(p_cfg, Model(**shape, num_blocks=11), engine=MooncakeEngine("127.0.0.1"))
    try:
        d.announce("L", 64)
        params = ms.take("L")
        assert d.wait_recv({"L"}, timeout_s=10.0)  # D gave up: every block is a load error
        for i in range(d.model.layers):  # vLLM recomputes the request into the same blocks
            d._write_layer("L", 99, i)
        p.prefill(params, 64, seed=1)  # P arrives late and pushes
        p.wait_idle()
        time.sleep(0.3)  # the notifier's messages and anything still in flight
        assert d.verify("L", 99) > 0  # D's recomputed KV, never P's late bytes
    finally:
        p.shutdown()
        d.shutdown()


class _DeviceWrite:
    """The fence a device gives at ``save_kv_layer``: its wait returns once the KV kernel ran (here: our write)."""

    def __init__(self) -> None:
        self.ran = threading.Event()
        self.waits = 0

    def fence(self) -> Any:
        return self._wait

    def _wait(self) -> None:
        self.waits += 1
        assert self.ran.wait(10.0), "the layer's KV write never ran"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "control-unfenced"])
def test_push_waits_for_the_device_write_that_save_kv_layer_only_enqueued(fenced: bool) -> None:
    """On an NPU or GPU ``save_kv_layer`` returns while the layer's KV write is still queued on the stream.

    Each layer's write lands 0.2 s after ``save_kv_layer``; with the fence D gets P's bytes. Control:
    the same run without the fence sends before the write and D's bytes differ (the check can fail).
    """
    port = free_port_range(1)
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}
    shape: dict[str, Any] = {"layers": 2, "heads": 2, "head_dim": 16, "block_size": 16}
    ms = CollectingMetaserver()
    d_cfg = LayerwiseConfig.from_kv_transfer_config(engine_id="fD", kv_role="kv_consumer", kv_port=port, extra=extra)
    p_cfg = LayerwiseConfig.from_kv_transfer_config(engine_id="fP", kv_role="kv_producer", kv_port=port, extra=extra)
    d = LwInstance(d_cfg, Model(**shape, num_blocks=24), engine=MooncakeEngine("127.0.0.1"), metaserver=ms)
    p = LwInstance(p_cfg, Model(**shape, num_blocks=11), engine=MooncakeEngine("127.0.0.1"))
    try:
        d.announce("F", 96)
        params = ms.take("F")
        req = p.requests["F"] = SchedRequest("F", 96, {**params, "do_remote_decode": True})
        p.scheduler.update_state_after_alloc(req, p._alloc("F", 96), 0)
        p.step({"F": Scheduled(0, 96)})
        writes: list[_DeviceWrite] = []
        for i in range(p.model.layers):
            name = p.model.layer_name(i)
            write = _DeviceWrite()
            writes.append(write)
            for r in p.ranks:
                r.worker.wait_for_layer_load(name)
                r.worker.save_kv_layer(name, write.fence if fenced else None)
            time.sleep(0.2)  # the stream is still busy: the kernel writes the layer's KV now
            p._write_layer("F", 5, i)
            write.ran.set()
        p.finish("F")
        assert d.wait_recv({"F"}, timeout_s=20.0) == set()
        if fenced:
            assert [w.waits for w in writes] == [1, 1]
            assert d.verify("F", 5) > 0
        else:
            with pytest.raises(AssertionError, match="differ"):
                d.verify("F", 5)
    finally:
        p.shutdown()
        d.shutdown()
