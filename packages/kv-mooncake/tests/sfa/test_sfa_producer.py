"""P's worker against a recording D endpoint (a real ROUTER), with a fake engine (our Protocol).

Checks what P puts on the wire: one hello, one read request per layer and step (the early hook and
the fallback do not both dispatch), chunk ranges, done ids only on the last layer, contributor
index and ratio, requests lacking blocks skipped; and that layers sharing storage share a gate.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ascend_dist.common.errors import LayoutError
from ascend_dist.common.regions import RegisterRegions
from ascend_dist.common.zmq_rpc import RpcServer
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.pull.config import Role
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.messages import (
    Commit,
    Committed,
    Hello,
    HelloAck,
    ReadDone,
    ReadReady,
    reply_codec,
    request_codec,
)
from ascend_dist.kv_mooncake.sfa.producer import ProducerWorker
from ascend_dist.kv_mooncake.sfa.scheduler import ProducerMetadata, SendReq


class FakeEngine:
    """Our engine interface's `Reader` view: accepts every registration and read."""

    @property
    def session(self) -> str:
        return "127.0.0.1:4321"

    @property
    def transport_ports(self) -> tuple[int, ...]:
        return ()

    def register(self, regions: RegisterRegions) -> None:
        pass

    def unregister(self, regions: RegisterRegions) -> None:
        pass

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        pass


class RecordingD:
    """A D endpoint that records every message and acknowledges it."""

    def __init__(self, port: int) -> None:
        self.got: list[Any] = []
        self.lock = threading.Lock()
        self._req, self._rep = request_codec(1 << 20), reply_codec(1 << 20)
        self.server = RpcServer("127.0.0.1", port, self._handle, name="recording-d")
        self.server.start()

    def _handle(self, payload: bytes) -> bytes:
        msg = self._req.decode(payload)
        with self.lock:
            self.got.append(msg)
        if isinstance(msg, Hello):
            reply: Any = HelloAck()
        elif isinstance(msg, Commit):
            reply = Committed()
        else:
            reply = ReadDone(layer_idx=msg.layer_idx)
        return self._rep.encode(reply)


def _caches(layers: int = 2, shared: bool = False) -> dict[str, Any]:
    main = [torch.zeros(16, 8, 32, dtype=torch.int16), torch.zeros(16, 8, 4, dtype=torch.int16)]
    out: dict[str, Any] = {}
    for i in range(layers):
        parts = main if shared else [torch.zeros_like(t) for t in main]
        out[f"model.layers.{i}.self_attn.attn"] = tuple(parts)
        out[f"model.layers.{i}.self_attn.indexer.k_cache"] = torch.zeros(16, 8, 8, dtype=torch.int16)
    return out


@pytest.fixture
def setup() -> Iterator[tuple[ProducerWorker, RecordingD]]:
    port = free_port_range(1)
    cfg = SfaConfig.from_kv_transfer_config(
        engine_id="P",
        kv_role=Role.PRODUCER.value,
        kv_port=port,
        extra={"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}, "transfer_backend": "mooncake"},
    )
    d = RecordingD(port)
    worker = ProducerWorker(cfg, tp_rank=1, backend=FakeEngine())
    worker.register_kv_caches(_caches(), block_size=8)
    yield worker, d
    worker.shutdown()
    d.server.stop()


def test_wire_output_of_two_chunked_steps(setup: Any) -> None:
    worker, d = setup
    d_port = d.server.port
    step1 = ProducerMetadata(
        (
            SendReq("a", (3, 4, 5), (9, 10, 11), "127.0.0.1", d_port, 1, 8, 0, 20, False),  # D holds 8 tokens
            SendReq("nob", (), (), "127.0.0.1", d_port, 1, 0, 0, 8, False),  # no blocks yet: skipped
        )
    )
    worker.start_load_kv(step1)
    for i in range(2):
        name = f"model.layers.{i}.self_attn.attn"
        worker.wait_for_layer_load(name)
        worker.on_kv_cache_written(name)
        worker.save_kv_layer(name)  # the fallback: already dispatched this step
    worker.start_load_kv(
        ProducerMetadata((SendReq("a", (3, 4, 5), (9, 10, 11), "127.0.0.1", d_port, 1, 8, 16, 20, True),))
    )
    for i in range(2):
        name = f"model.layers.{i}.self_attn.attn"
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name)
    for i in range(2):
        worker.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
    worker.shutdown()  # joins the link: its commit after the last layer went out
    assert worker.take_failed() == {}
    hello, *reads, commit = d.got
    assert commit == Commit(sender="P/tp1", ext_ids=["a"], group_member_idx=1, tp_ratio=2)
    assert isinstance(hello, Hello) and hello.session == "127.0.0.1:4321" and hello.sender == "P/tp1"
    assert [len(layer.main) for layer in hello.layers.values()] == [2, 2]
    assert all(isinstance(r, ReadReady) for r in reads) and len(reads) == 4
    r0, r1, r2, r3 = reads
    assert (r0.group_member_idx, r0.tp_ratio) == (1, 2)  # P rank 1 of 2 feeds D rank 0
    # step 1: 20 tokens computed, D holds 8: blocks [1, 2) (the partial third block waits)
    assert [(q.ext_id, q.p_main_ids, q.p_indexer_ids, q.main_start) for q in r0.reads] == [("a", [4], [10], 1)]
    assert r0.done_ext_ids == [] and r1.done_ext_ids == []
    # step 2: the prompt ends at 20 tokens: blocks [2, 3), done on the last layer only
    assert [(q.p_main_ids, q.main_start) for q in r2.reads] == [([5], 2)]
    assert r2.done_ext_ids == [] and r3.done_ext_ids == ["a"]
    assert all(r.read_budget_ms > 0 for r in reads)


def test_layers_sharing_storage_share_a_gate() -> None:
    cfg = SfaConfig.from_kv_transfer_config(
        engine_id="P",
        kv_role=Role.PRODUCER.value,
        kv_port=free_port_range(1),
        extra={"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "transfer_backend": "mooncake"},
    )
    worker = ProducerWorker(cfg, tp_rank=0, backend=FakeEngine())
    try:
        worker.register_kv_caches(_caches(shared=True), block_size=8)
        g0 = worker.gates("model.layers.0.self_attn.attn")
        assert g0[0] is worker.gates("model.layers.1.self_attn.attn")[0]  # same main storage
        assert g0 == worker.gates("model.layers.0.self_attn.indexer.k_cache")
        with pytest.raises(LayoutError, match="main tensors"):
            worker.register_kv_caches(
                {"model.layers.0.attn": (torch.zeros(4, 2), torch.zeros(4, 2), torch.zeros(4, 2))}, block_size=8
            )
        with pytest.raises(LayoutError, match="indexer"):
            worker.register_kv_caches({"model.layers.3.indexer.k": torch.zeros(4, 2)}, block_size=8)
    finally:
        worker.shutdown()
