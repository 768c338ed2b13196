"""MooncakeConnectorV1 over caches allocated by vLLM 0.33 itself, in each of its KV-cache layouts.

vLLM >= 0.32 hands the connector one ``[B, H, N, C]`` view per attention layer (K and V fused in
``C``), laid out by the resolved ``cache_config.kv_cache_layout``. Here the caches come from
vLLM's own ``allocate_kv_cache`` (one flat buffer, ``create_kv_cache_views`` with the layout's
strides) for LBHNC (head-major, vLLM's CPU attention), LBNHC (token-major) and BLHNC
(block-outermost: a layer's blocks lie a packed block of both layers apart); P and D are built by
vLLM's factory and D's pull must be byte-exact. LHBNC is refused at registration naming the
layout, and a P on another layout than D's at the handshake, naming both.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from ascend_dist.common.errors import LayoutError  # noqa: E402
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.pull.vllm_connector import MooncakeConnectorV1Metadata  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402

MODULE = "ascend_dist.kv_mooncake.pull.vllm_connector"
LW_MODULE = "ascend_dist.kv_mooncake.push.vllm_connector"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
NUM_BLOCKS = vb.NUM_BLOCKS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vb.write_model_dir(tmp_path_factory.mktemp("tiny-llama-layouts"))


def kv_cache_config(layout: str) -> KVCacheConfig:
    """Both layers in one backing tensor, their layer and block strides by vLLM's rule for ``layout``."""
    spec = vb.attention_spec(2, 16)
    strides = compute_layout_strides(spec, NUM_BLOCKS, len(LAYERS), KVCacheLayout[layout])  # bytes, [L, B, H, N, C]
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * NUM_BLOCKS * len(LAYERS),
        layers=list(LAYERS),
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        kv_cache_layout=layout,
    )


class Side:
    """One instance on one layout: both connector roles from vLLM's factory, caches from vLLM's allocator."""

    def __init__(
        self, model_dir: Path, role: str, port: int, layout: str, *, seed: int, connector: str = "MooncakeConnectorV1"
    ) -> None:
        engine_id = f"{'P' if role == 'kv_producer' else 'D'}-{layout}-{seed}"
        config = vb.make_vllm_config(
            model_dir,
            connector=connector,
            module=MODULE if connector == "MooncakeConnectorV1" else LW_MODULE,
            role=role,
            engine_id=engine_id,
            kv_port=port,
            extra={},
        )
        config.cache_config.kv_cache_layout = layout  # what the engine core resolves (vLLM's CPU build: LBHNC)
        kcc = kv_cache_config(layout)
        self.caches = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout])
        gen = torch.Generator().manual_seed(seed)
        for view in self.caches.values():
            view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))
        self.sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kcc)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)

    def register(self) -> None:
        self.worker.register_kv_caches(self.caches)

    def step(self) -> None:
        meta = self.sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, MooncakeConnectorV1Metadata)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.clear_connector_metadata()

    def block(self, b: int) -> list[torch.Tensor]:
        return [self.caches[n][b].clone() for n in LAYERS]  # [H, N, C] of each layer

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def _pull(p: Side, d: Side, rid: str) -> set[int]:
    """P prefills 40 tokens in blocks 4..6, D pulls them into 21..23; returns D's load errors."""
    req_p = vb.request(f"p-{rid}", 40, {"do_remote_decode": True})
    p.sched.update_state_after_alloc(req_p, vb.blocks([4, 5, 6]), 0)
    p.step()
    req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.sched.request_finished(req_p, [4, 5, 6])
    p.step()
    req_d = vb.request(f"d-{rid}", 40, params)
    assert d.sched.get_num_new_matched_tokens(req_d, 0) == (40, True)
    d.sched.update_state_after_alloc(req_d, vb.blocks([21, 22, 23]), 40)
    d.step()
    done: set[str] = set()
    deadline = time.monotonic() + 20
    while f"d-{rid}" not in done and time.monotonic() < deadline:
        done |= d.worker.get_finished(set())[1] or set()
        time.sleep(0.005)
    assert f"d-{rid}" in done
    return d.worker.get_block_ids_with_load_errors()


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC"])
def test_pull_over_vllm_allocated_caches_is_byte_exact(model_dir: Path, layout: str) -> None:
    port = free_port_range(1)
    p = Side(model_dir, "kv_producer", port, layout, seed=1)
    d = Side(model_dir, "kv_consumer", port, layout, seed=2)
    try:
        view = p.caches[LAYERS[1]]
        assert tuple(view.shape) == (NUM_BLOCKS, 2, vb.BLOCK, 32)  # [B, H, N, C]: K and V fused
        p.register()
        d.register()
        untouched = d.block(20)
        assert _pull(p, d, "r") == set()
        for db, pb in ((21, 4), (22, 5), (23, 6)):
            assert all(torch.equal(x, y) for x, y in zip(d.block(db), p.block(pb), strict=True)), (layout, db)
        assert all(torch.equal(x, y) for x, y in zip(d.block(20), untouched, strict=True))
    finally:
        d.close()
        p.close()


def test_heads_outside_blocks_are_refused_at_registration(model_dir: Path) -> None:
    side = Side(model_dir, "kv_consumer", free_port_range(1), "LHBNC", seed=3)
    try:
        with pytest.raises(LayoutError, match=r"kv_cache_layout='LHBNC' is invalid"):
            side.register()
    finally:
        side.close()


def test_p_and_d_on_different_layouts_are_refused_naming_the_field(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port_range(1)
    p = Side(model_dir, "kv_producer", port, "LBHNC", seed=4)
    d = Side(model_dir, "kv_consumer", port, "LBNHC", seed=5)
    try:
        p.register()
        d.register()
        with caplog.at_level(logging.ERROR, logger="ascend_dist.kv_mooncake.pull.threads"):
            assert _pull(p, d, "m") == {21, 22, 23}  # nothing read; vLLM recomputes
        # D names the field and its own layout; P's value is never disclosed to the asker (wire v3).
        assert "layout differs (local='kv/LBNHC', remote='(not disclosed)')" in caplog.text
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize(("layout", "head_major"), [("LBHNC", True), ("BLNHC", False)])
def test_layerwise_worker_reads_vllm_allocated_caches(model_dir: Path, layout: str, head_major: bool) -> None:
    side = Side(model_dir, "kv_consumer", free_port_range(1), layout, seed=6, connector="MooncakeLayerwiseConnector")
    try:
        side.worker.register_kv_caches(side.caches)
        worker = side.worker._worker  # the package's LayerwiseWorker behind vLLM's connector
        assert worker is not None and dict(worker.make_handshake(vb.BLOCK).compat_fields)["layout"] == f"kv/{layout}"
        meta = worker._metas[LAYERS[0]][0]
        assert (meta.heads, meta.tokens, meta.head_bytes, meta.head_major) == (2, vb.BLOCK, 64, head_major)
    finally:
        side.close()
    lhbnc = Side(model_dir, "kv_consumer", free_port_range(1), "LHBNC", seed=7, connector="MooncakeLayerwiseConnector")
    try:
        with pytest.raises(LayoutError, match="LHBNC"):
            lhbnc.worker.register_kv_caches(lhbnc.caches)
    finally:
        lhbnc.close()
