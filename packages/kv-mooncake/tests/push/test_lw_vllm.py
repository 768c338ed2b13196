"""MooncakeLayerwiseConnector against the real vLLM 0.33.0 classes (factory, configs, requests, scheduler output).

P and D connectors (scheduler and worker roles each, built by vLLM's ``KVConnectorFactory``) run in
this process over the real Mooncake engine (TCP, loopback) and a real local HTTP metaserver: D's
scheduler announces ALL its blocks to the metaserver, the test (the proxy) hands the announcement to
P, P's scheduler turns vLLM's ``SchedulerOutput`` into per-step pushes, P's worker pushes each layer
at ``save_kv_layer``, and D's worker reports the request received with P's bytes in D's blocks.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

import push_vllm_support as support  # noqa: E402
import torch  # noqa: E402
from push_vllm_support import BLOCK, LAYERS, NUM_BLOCKS, kv_cache_config, make_config  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput  # noqa: E402

from ascend_dist.common.errors import ConfigError  # noqa: E402
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.push.vllm_connector import (  # noqa: E402
    MooncakeLayerwiseConnector,
    MooncakeLayerwiseMetadata,
)
from ascend_dist.testing import vllm_builders as vb  # noqa: E402
from ascend_dist.testing.vllm_stats import read_back  # noqa: E402

blocks = vb.blocks
request = vb.request
model_dir = support.model_dir  # the tiny-llama config directory fixture


class Side(vb.Side):
    """Scheduler-role and worker-role connectors from vLLM's factory, with CPU caches."""

    def __init__(self, config: VllmConfig, seed: int) -> None:
        super().__init__(config, seed, LAYERS, kv_cache_config(), MooncakeLayerwiseMetadata)

    def step(self, out: SchedulerOutput) -> None:
        self.run_step(out)


class _Metaserver(http.server.BaseHTTPRequestHandler):
    posted: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        self.posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_layerwise_push_through_the_vllm_connector(model_dir: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metaserver)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/metaserver"
    port = free_port_range(1)
    d = Side(make_config(model_dir, "kv_consumer", "D-lw", port), seed=2)
    p_config = make_config(model_dir, "kv_producer", "P-lw", port)
    p = Side(p_config, seed=1)
    try:
        assert isinstance(d.sched, MooncakeLayerwiseConnector) and isinstance(p.worker, MooncakeLayerwiseConnector)
        # D: a 40-token prompt, 16 tokens already cached locally (block 20); P pushes the rest.
        req_d = request("lw-req", 40, {"do_remote_prefill": True, "metaserver": url})
        assert d.sched.get_num_new_matched_tokens(req_d, 16) == (24, True)
        d.sched.update_state_after_alloc(req_d, blocks([20, 21, 22]), 24)
        d.step(SchedulerOutput.make_empty())
        deadline = time.monotonic() + 20
        while not _Metaserver.posted and time.monotonic() < deadline:
            time.sleep(0.01)
        params = _Metaserver.posted.pop()
        assert params["remote_block_ids"] == [[20, 21, 22]] and params["remote_cached_tokens"] == 16
        # The proxy sends the original request to P with D's params; P prefills it in blocks 4, 5, 6.
        req_p = request("lw-req", 40, {**params, "do_remote_decode": True})
        assert p.sched.get_num_new_matched_tokens(req_p, 0) == (0, False)
        p.sched.update_state_after_alloc(req_p, blocks([4, 5, 6]), 0)
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = [NewRequestData.from_request(req_p, ([4, 5, 6],))]
        out.num_scheduled_tokens = {"lw-req": 40}
        p.step(out)
        for name in LAYERS:  # the forward: gate, attention writes the layer's KV, save pushes it
            p.worker.wait_for_layer_load(name)
            p.worker.save_kv_layer(name, p.caches[name], None)
        p.worker.wait_for_save()
        assert p.sched.request_finished(req_p, [4, 5, 6]) == (False, None)  # P frees at once
        finished: set[str] = set()
        while "lw-req" not in finished and time.monotonic() < deadline:
            finished |= d.worker.get_finished(set())[1] or set()
            time.sleep(0.005)
        assert "lw-req" in finished and d.worker.get_block_ids_with_load_errors() == set()
        assert [d.block(b) for b in (21, 22)] == [p.block(b) for b in (5, 6)]
        assert d.block(20) != p.block(4)  # the prefix hit was not overwritten
        for name in LAYERS:
            p.worker.wait_for_layer_reuse(name)  # every push finished: the storage may be reused
        # transfer stats (issue 26): P's pushes are its writes, read back through vLLM's objects
        pushed = p.worker.get_kv_connector_stats()
        assert pushed is not None and d.worker.get_kv_connector_stats() is None  # D reads nothing: P writes
        out = read_back(p_config, pushed.to_dict())
        assert out.sample("vllm:mooncake_bytes_transferred_sum") == len(d.block(21)) + len(d.block(22))
        assert out.sample("vllm:mooncake_num_descriptors_sum") >= len(LAYERS)  # at least one per layer's push
        assert "p2p save: Num successful transfers=" in out.lines[0]
    finally:
        d.close()
        p.close()
        server.shutdown()
        server.server_close()


def test_invalid_config_is_a_typed_error_naming_the_field(model_dir: Path) -> None:
    config = make_config(model_dir, "kv_consumer", "D-bad", 40000, decode={"tp_size": 1, "pp_size": 2})
    with pytest.raises(ConfigError, match=r"decode\.pp_size"):
        MooncakeLayerwiseConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    config = make_config(model_dir, "kv_producer", "P-bad", 40000, tls_config={"ssl_enable": 1})
    with pytest.raises(ConfigError, match=r"tls_config\.ssl_enable"):
        MooncakeLayerwiseConnector(config, KVConnectorRole.WORKER, kv_cache_config())


def test_a_request_p_never_pushes_is_failed_by_request_with_two_kv_groups(model_dir: Path) -> None:
    """vLLM 0.33 raises on block-level failures with several KV groups: D reports the request instead."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metaserver)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/metaserver"
    spec = vb.attention_spec(2, 16)
    kcc = vb.kv_cache_config([([LAYERS[0]], spec), ([LAYERS[1]], spec)])
    config = make_config(model_dir, "kv_consumer", "D-lw2", free_port_range(1), first_layer_timeout_s=1.0)
    sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kcc)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
    worker.register_kv_caches({n: torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.float16) for n in LAYERS})
    try:
        req = request("lw-2g", 40, {"do_remote_prefill": True, "metaserver": url})
        assert sched.get_num_new_matched_tokens(req, 0) == (40, True)
        sched.update_state_after_alloc(req, blocks([3, 4, 5], [3, 4, 5]), 40)
        worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput.make_empty()))
        worker.start_load_kv(None)  # type: ignore[arg-type]
        worker.clear_connector_metadata()
        deadline = time.monotonic() + 20
        results = worker.get_transfer_results(set())
        while "lw-2g" not in results.finished_recving and time.monotonic() < deadline:
            time.sleep(0.02)
            results = worker.get_transfer_results(set())
        assert results.finished_recving == {"lw-2g"} and results.failed_recving == {"lw-2g"}
        assert worker.get_block_ids_with_load_errors() == set()  # never block ids with two groups
    finally:
        worker.shutdown()
        sched.shutdown()
        server.shutdown()
        server.server_close()
