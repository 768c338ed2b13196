"""SFA D's host pool is the sparse offload manager's: decode onloads exactly the rows P sent (issue 24 item 4).

Real parts: P and D ``SfaRemoteD2HConnector``s built by vLLM's ``KVConnectorFactory`` (one Mooncake
engine over TCP on loopback, a real HTTP metaserver), kv-offload's `SparseOffloadManager` from
`get_manager` on the CPU device simulation. The two packages never import each other; they meet
in ``ascend_dist.common.host_pool_share``. Main caches are vllm-ascend's (nope, rope) pair per layer.
D runs on simulated device 1 while another manager of another geometry holds device 0's pool: each
rank pairs with its own device's pool.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
pytest.importorskip("ascend_dist.kv_mooncake.sfa.vllm_connector")
pytest.importorskip("ascend_dist.kv_offload.sparse_manager")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402

from ascend_dist.common.device import current_device_index, get_runtime, set_current_device  # noqa: E402
from ascend_dist.common.errors import ConfigError  # noqa: E402
from ascend_dist.common.host_pool_share import held_host_pool  # noqa: E402
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.sfa.vllm_connector import SfaRemoteD2HConnector  # noqa: E402
from ascend_dist.kv_offload.sparse_manager import (  # noqa: E402
    SparseGeometry,
    SparseOffloadManager,
    get_manager,
    reset_manager,
)
from ascend_dist.testing import hostile as hr  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402

MODULE = "ascend_dist.kv_mooncake.sfa.vllm_connector"
MAIN = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
INDEXER = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2)]
NB, BLOCK = vb.NUM_BLOCKS, vb.BLOCK
NOPE, ROPE = 48, 16  # float16 elements per token: the manager's kv_lora_rank and rope_dim
GEO = SparseGeometry(
    num_layers=2, num_blocks=NB, block_size=BLOCK, kv_lora_rank=NOPE, rope_dim=ROPE, rows=1, topk=8,
    cap=2 * BLOCK, max_model_len=NB * BLOCK,
)  # fmt: skip
P_BLOCKS, D_BLOCKS = [3, 4, 5], [7, 8, 9]  # the request's 40 tokens on P and on D
TOPK = [0, 5, 15, 16, 23, 31, 32, 39]  # token positions the indexer picks (all three blocks)
D_DEVICE = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vb.write_model_dir(tmp_path_factory.mktemp("tiny-mla"), num_key_value_heads=1)


@pytest.fixture
def metaserver() -> Iterator[hr.Metaserver]:
    m = hr.Metaserver()
    yield m
    m.close()


@pytest.fixture
def on_device_1() -> Iterator[None]:
    before = current_device_index()
    reset_manager()
    yield
    reset_manager()
    set_current_device(before)


def _config(model_dir: Path, role: str, engine_id: str, port: int) -> Any:
    return vb.make_vllm_config(
        model_dir, connector="SfaRemoteD2HConnector", module=MODULE, role=role, engine_id=engine_id, kv_port=port,
        extra={"transfer_backend": "mooncake"},
    )  # fmt: skip


def _kcc() -> Any:
    return vb.kv_cache_config([(MAIN, vb.attention_spec(1, NOPE + ROPE)), (INDEXER, vb.attention_spec(1, 16))])


def _caches(seed: int) -> dict[str, Any]:
    """vllm-ascend's MLA caches: a (nope, rope) pair per main layer, one indexer tensor per layer."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {
        n: (torch.randn(NB, BLOCK, NOPE, generator=gen).half(), torch.randn(NB, BLOCK, ROPE, generator=gen).half())
        for n in MAIN
    }
    return out | {n: torch.randn(NB, BLOCK, 16, generator=gen).half() for n in INDEXER}


def _bind(connector: Any, meta: Any) -> None:
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)


def _transfer(
    p_work: Any, p_sched: Any, d_work: Any, d_sched: Any, *, p_caches: dict[str, Any], meta: hr.Metaserver, hasher: Any
) -> None:
    """One 40-token request, prefilled by P in two chunks, read by D layer by layer (as test_sfa_vllm)."""
    url, got = meta.url, meta.got
    req_d = vb.request("cmpl-7-0-0123abcd", 40, {"do_remote_prefill": True, "metaserver": url}, max_tokens=4,
                       hasher=hasher)  # fmt: skip
    assert d_sched.get_num_new_matched_tokens(req_d, 0) == (40, True)
    d_sched.update_state_after_alloc(req_d, vb.blocks(D_BLOCKS, [20, 21, 22]), 40)
    _bind(d_work, d_sched.build_connector_meta(SchedulerOutput.make_empty()))
    deadline = time.monotonic() + 10
    while "cmpl-7-0" not in got:
        assert time.monotonic() < deadline, "D's contact never reached the metaserver"
        time.sleep(0.01)
    req_p = vb.request("cmpl-7-0-89abcdef", 40, {**got["cmpl-7-0"], "do_remote_decode": True}, hasher=hasher)
    p_sched.update_state_after_alloc(req_p, vb.blocks(P_BLOCKS[:2], [11, 12]), 0)
    out1 = SchedulerOutput.make_empty()
    out1.scheduled_new_reqs = [NewRequestData.from_request(req_p, (P_BLOCKS[:2], [11, 12]))]
    out1.num_scheduled_tokens = {req_p.request_id: 24}
    out2 = SchedulerOutput.make_empty()
    out2.scheduled_cached_reqs = CachedRequestData.make_empty()
    out2.scheduled_cached_reqs.req_ids = [req_p.request_id]
    out2.scheduled_cached_reqs.new_block_ids = [([P_BLOCKS[2]], [13])]
    out2.scheduled_cached_reqs.num_computed_tokens = [24]
    out2.num_scheduled_tokens = {req_p.request_id: 16}
    for out in (out1, out2):
        _bind(p_work, p_sched.build_connector_meta(out))
        for layer in range(2):
            for name in (INDEXER[layer], MAIN[layer]):
                p_work.wait_for_layer_load(name)
            p_work.save_kv_layer(MAIN[layer], p_caches[MAIN[layer]], None)
        p_work.clear_connector_metadata()
    p_sched.request_finished(req_p, P_BLOCKS)
    done: set[str] = set()
    while req_d.request_id not in done:
        assert time.monotonic() < deadline + 10, "D never finished receiving"
        done |= d_work.get_finished(set())[1] or set()
        time.sleep(0.005)
    assert d_work.get_block_ids_with_load_errors() == set()
    d_sched.request_finished(req_d, D_BLOCKS)


def _p_row(p_caches: dict[str, Any], layer: int, part: int, token: int) -> torch.Tensor:
    """P's bytes of the request's token ``token`` (logical position) in part 0 (nope) or 1 (rope)."""
    block, off = P_BLOCKS[token // BLOCK], token % BLOCK
    return p_caches[MAIN[layer]][part][block, off].contiguous().view(torch.int8)


def _onloads_p_rows(mgr: SparseOffloadManager, p_caches: dict[str, Any]) -> bool:
    """Decode's step: the manager onloads the top-k tokens; are the hot-buffer rows exactly P's bytes?"""
    same = True
    for layer in range(2):
        slots = mgr.onload_topk_kv(layer, np.array([TOPK]), np.array([1]), np.array([40]), np.array([D_BLOCKS]))
        mgr.rt.compute_stream().synchronize(5.0)
        for pos, token in enumerate(TOPK):
            s = int(slots[0, pos])
            assert s >= 0, (layer, token)
            same &= torch.equal(mgr.hot_k[layer][0, s], _p_row(p_caches, layer, 0, token))
            same &= torch.equal(mgr.hot_v[layer][0, s], _p_row(p_caches, layer, 1, token))
    mgr.synchronize()
    return same


@pytest.mark.parametrize("first", ["manager", "d_worker"])
def test_decode_onloads_the_rows_p_sent_into_the_shared_pool(
    model_dir: Path, metaserver: hr.Metaserver, on_device_1: None, first: str
) -> None:
    """Either order: the second of D and the manager gets the first's pool; the manager's onload is P's bytes.

    Control: a manager with its own pool (what decode had before the wiring) onloads rows that are not P's.
    """
    port = free_port_range(1)
    p_cfg, d_cfg = _config(model_dir, "kv_producer", "P-hp", port), _config(model_dir, "kv_consumer", "D-hp", port)
    other = SparseOffloadManager(
        get_runtime(0), SparseGeometry(**{**GEO.__dict__, "num_blocks": 4}), share_host_pool=True
    )
    made: list[Any] = []
    try:
        p_sched = KVConnectorFactory.create_connector(p_cfg, KVConnectorRole.SCHEDULER, _kcc())
        p_work = KVConnectorFactory.create_connector(p_cfg, KVConnectorRole.WORKER, _kcc())
        d_sched = KVConnectorFactory.create_connector(d_cfg, KVConnectorRole.SCHEDULER, _kcc())
        made += [p_sched, p_work, d_sched]
        set_current_device(D_DEVICE)  # vLLM's worker makes its device current before building the connector
        d_work = KVConnectorFactory.create_connector(d_cfg, KVConnectorRole.WORKER, _kcc())
        made.append(d_work)
        assert isinstance(d_work, SfaRemoteD2HConnector) and d_work.device_index == D_DEVICE
        p_caches, d_caches = _caches(1), _caches(2)
        p_work.register_kv_caches(p_caches)
        if first == "manager":
            mgr = get_manager(get_runtime(D_DEVICE), GEO)
            d_work.register_kv_caches(d_caches)
        else:
            d_work.register_kv_caches(d_caches)
            mgr = get_manager(get_runtime(D_DEVICE), GEO)
        hasher = vb.block_hasher(d_cfg, _kcc())
        _transfer(p_work, p_sched, d_work, d_sched, p_caches=p_caches, meta=metaserver, hasher=hasher)
        for layer in range(2):  # D's view: P's blocks landed in the pool
            assert torch.equal(d_work.host_pool[MAIN[layer]][0][D_BLOCKS], p_caches[MAIN[layer]][0][P_BLOCKS])
        assert _onloads_p_rows(mgr, p_caches)
        # One pool per device: D's views are the manager's tensors; device 0's pool is the other manager's.
        assert held_host_pool(D_DEVICE) is not None and held_host_pool(0) is not None
        assert d_work.host_pool[MAIN[0]][0].data_ptr() == mgr.host_k[0].data_ptr()
        assert d_work.host_pool[MAIN[1]][1].data_ptr() == mgr.host_v[1].data_ptr()
        assert other.host_k[0].data_ptr() != mgr.host_k[0].data_ptr()
        control = SparseOffloadManager(get_runtime(D_DEVICE), GEO)  # its own pool: nothing P sent is in it
        for t in (*control.host_k, *control.host_v):
            t.zero_()
        assert not _onloads_p_rows(control, p_caches)
    finally:
        for c in made:
            c.shutdown()
        other.close()
    reset_manager()
    assert held_host_pool(D_DEVICE) is None and held_host_pool(0) is None  # every claim was released


def test_a_pool_of_another_geometry_is_refused_naming_the_field(model_dir: Path, on_device_1: None) -> None:
    """The manager first with a wider nope, or D's blocks head-major: D refuses; D first: the manager refuses."""
    set_current_device(D_DEVICE)
    d_work = KVConnectorFactory.create_connector(
        _config(model_dir, "kv_consumer", "D-geo", free_port_range(1)), KVConnectorRole.WORKER, _kcc()
    )
    try:
        mgr = get_manager(get_runtime(D_DEVICE), SparseGeometry(**{**GEO.__dict__, "kv_lora_rank": NOPE + 8}))
        with pytest.raises(ConfigError, match=r"host_pool\.token_bytes.*SparseOffloadManager"):
            d_work.register_kv_caches(_caches(3))
        assert held_host_pool(D_DEVICE) is not None and mgr.host_k[0].shape[1] == 2 * (NOPE + 8)
        reset_manager()
        # Same bytes per token, but two heads stored head-major inside each block: the manager's token
        # rows would be other tokens' bytes. Refused by name (control: the token-major caches below pass).
        get_manager(get_runtime(D_DEVICE), GEO)
        head_major = {
            n: (torch.zeros(NB, 2, BLOCK, NOPE // 2).half().permute(0, 2, 1, 3), torch.zeros(NB, BLOCK, 1, ROPE).half())
            for n in MAIN
        }
        with pytest.raises(ConfigError, match=r"host_pool\.token_major=False"):
            d_work.register_kv_caches(head_major | {n: torch.zeros(NB, BLOCK, 16).half() for n in INDEXER})
        reset_manager()
        d_work.register_kv_caches(_caches(3))
        with pytest.raises(ConfigError, match=r"host_pool\.num_blocks.*SfaRemoteD2HConnector"):
            get_manager(get_runtime(D_DEVICE), SparseGeometry(**{**GEO.__dict__, "num_blocks": NB - 1}))
    finally:
        d_work.shutdown()
    assert held_host_pool(D_DEVICE) is None
