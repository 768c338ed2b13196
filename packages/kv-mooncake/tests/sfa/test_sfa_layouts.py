"""SFA's register path reads KV layouts like the pull connector and refuses the ones it cannot serve.

vLLM >= 0.32 hands one ``[B, 1, N, C]`` view per MLA/indexer layer (`synthetic_layouts` rebuilds
them); SFA reads whole blocks, so blocks must lie back to back: layer-compact layouts are served,
block-outermost ones (BLHNC) refused naming the layout, and D refuses a P on another layout at
the hello naming both.
"""

from __future__ import annotations

import pytest

from ascend_dist.common.errors import LayoutError
from ascend_dist.common.regions import RegisterRegions
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.synthetic_layouts import build_attention_caches
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.kv_views import label_kv_caches
from ascend_dist.kv_mooncake.core.messages import Refused
from ascend_dist.kv_mooncake.pull.config import Role
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.consumer import ConsumerWorker
from ascend_dist.kv_mooncake.sfa.messages import Hello, LayerMeta, TensorSpan, reply_codec, request_codec
from ascend_dist.kv_mooncake.sfa.plan import DestLayer
from ascend_dist.kv_mooncake.sfa.producer import ProducerWorker, make_sfa_handshake, span_label

MAIN = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
INDEXER = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2)]


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


def _config(role: Role) -> SfaConfig:
    return SfaConfig.from_kv_transfer_config(
        engine_id="P" if role is Role.PRODUCER else "D",
        kv_role=role.value,
        kv_port=free_port_range(1),
        extra={"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "transfer_backend": "mooncake"},
        model="m",
    )


def _native_caches(layout: str) -> dict:
    main = build_attention_caches(layout, MAIN, blocks=16, tokens=8, heads=1, dims=(32, 4), mla=True)
    idx = build_attention_caches(layout, INDEXER, blocks=16, tokens=8, heads=1, dims=(8,), mla=True)
    return {**main.raw, **idx.raw}


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_p_registers_vllm_views_and_names_the_layout_in_its_hello(layout: str) -> None:
    parts, lay = label_kv_caches(_native_caches(layout), native=True, layout_name=layout)
    worker = ProducerWorker(_config(Role.PRODUCER), tp_rank=0, backend=FakeEngine())
    try:
        worker.register_kv_caches(parts, block_size=8, layout=lay)
        hello = worker._make_hello()
        assert dict(hello.handshake.compat_fields)["layout"] == layout
        meta = hello.layers[MAIN[0]]
        assert [s.block_bytes for s in meta.main] == [8 * 36 * 2] and [s.block_bytes for s in meta.indexer] == [128]
    finally:
        worker.shutdown()


def test_block_outermost_layouts_are_refused_naming_the_layout() -> None:
    parts, lay = label_kv_caches(_native_caches("BLHNC"), native=True, layout_name="BLHNC")
    worker = ProducerWorker(_config(Role.PRODUCER), tp_rank=0, backend=FakeEngine())
    try:
        with pytest.raises(LayoutError, match=r"kv_cache_layout='BLHNC' is invalid: expected blocks back to back"):
            worker.register_kv_caches(parts, block_size=8, layout=lay)
    finally:
        worker.shutdown()
    assert span_label(None, [("x", parts[MAIN[0]][0])]) == "NHD"  # no name: the order the strides show


def test_d_refuses_a_p_on_another_layout_naming_both() -> None:
    config = _config(Role.CONSUMER)
    worker = ConsumerWorker(config, tp_rank=0, backend=FakeEngine())
    worker.register({MAIN[0]: DestLayer((50_000,), (64,), (90_000,), (16,))}, [(50_000, 6400)], layout="LBNHC")
    layer = LayerMeta(layer_idx=0, main=[TensorSpan(1000, 64)], indexer=[TensorSpan(9000, 16)])
    hello = Hello(
        handshake=make_sfa_handshake(_config(Role.PRODUCER), "P/tp0", 1, "LBHNC"),
        engine_id="P",
        sender="P/tp0",
        session="peer:1",
        layers={MAIN[0]: layer},
    )
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)
    try:
        with RpcClient(timeout_s=5.0, retries=1) as client:
            reply = replies.decode(client.request(tcp_endpoint("127.0.0.1", worker.port), requests.encode(hello)))
        assert isinstance(reply, Refused), reply
        assert (reply.field, reply.local, reply.remote) == ("layout", "", "LBHNC")  # never D's own value
    finally:
        worker.shutdown()
