"""MooncakeConnectorV1 against the real vLLM 0.33.0 classes (factory, configs, requests, blocks).

A P and a D connector pair (scheduler role and worker role each, built by vLLM's
``KVConnectorFactory``) run in this process over one real Mooncake engine (TCP, loopback): P's
scheduler returns kv_transfer_params, D's scheduler turns them into a pull, D's worker pulls P's
blocks byte-exact into the blocks D allocated, and P frees its blocks after D's DONE.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

import pull_vllm_support as support  # noqa: E402
import torch  # noqa: E402
from pull_vllm_support import BLOCK, LAYERS, NUM_BLOCKS, Side, blocks, kv_cache_config, make_config, request  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dist.common.errors import ConfigError  # noqa: E402
from ascend_dist.common.secret import SECRET_ENV  # noqa: E402
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.pull.vllm_connector import MooncakeConnectorV1  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402

model_dir = support.model_dir  # the tiny-llama config directory fixture


def test_p_to_d_pull_through_the_vllm_connector(model_dir: Path) -> None:
    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-vllm", port), seed=1)
    d = Side(make_config(model_dir, "kv_consumer", "D-vllm", port), seed=2)
    try:
        assert isinstance(p.sched, MooncakeConnectorV1) and isinstance(d.worker, MooncakeConnectorV1)
        # P: prefill of a 40-token prompt in blocks 4, 5, 6 (+ one lookahead block that is trimmed).
        req_p = request("p-req", 40, {"do_remote_decode": True})
        assert p.sched.get_num_new_matched_tokens(req_p, 0) == (0, False)
        p.sched.update_state_after_alloc(req_p, blocks([4, 5, 6, 7]), 0)
        p.step()
        req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
        delay, params = p.sched.request_finished(req_p, [4, 5, 6, 7])
        assert delay is True and params is not None and params["remote_block_ids"] == [[4, 5, 6]]
        p.step()
        # D: the proxy hands P's params over; D has a 16-token prefix hit (block 20) and pulls the rest.
        req_d = request("d-req", 40, params)
        assert d.sched.get_num_new_matched_tokens(req_d, 16) == (24, True)
        d.sched.update_state_after_alloc(req_d, blocks([21, 22]), 24)
        d.step()
        finished: set[str] = set()
        deadline = time.monotonic() + 20
        while "d-req" not in finished and time.monotonic() < deadline:
            finished |= d.worker.get_finished(set())[1] or set()
            time.sleep(0.005)
        assert "d-req" in finished and d.worker.get_block_ids_with_load_errors() == set()
        assert [d.block(b) for b in (21, 22)] == [p.block(b) for b in (5, 6)]
        sent: set[str] = set()
        while "p-req" not in sent and time.monotonic() < deadline:
            sent |= p.worker.get_finished(set())[0] or set()
            time.sleep(0.005)
        assert sent == {"p-req"}  # P may free its blocks now
    finally:
        d.close()
        p.close()


def _pull_once(p: Side, d: Side, rid: str, p_blocks: list[int], d_blocks: list[int], *, forge: Any = None) -> set[int]:
    """P prefills ``rid`` into ``p_blocks``; D pulls its params (JSON, as through a proxy; ``forge``
    edits them first) into ``d_blocks``; returns D's load errors once D reports the request."""
    req_p = request(f"p-{rid}", 40, {"do_remote_decode": True})
    p.sched.get_num_new_matched_tokens(req_p, 0)
    p.sched.update_state_after_alloc(req_p, blocks(p_blocks), 0)
    p.step()
    req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.sched.request_finished(req_p, p_blocks)
    p.step()
    assert params is not None
    params = json.loads(json.dumps(params))
    if forge is not None:
        params = forge(params)
    req_d = request(f"d-{rid}", 40, params)
    assert d.sched.get_num_new_matched_tokens(req_d, 0) == (40, True)
    d.sched.update_state_after_alloc(req_d, blocks(d_blocks), 40)
    d.step()
    finished: set[str] = set()
    deadline = time.monotonic() + 20
    while f"d-{rid}" not in finished and time.monotonic() < deadline:
        finished |= d.worker.get_finished(set())[1] or set()
        time.sleep(0.005)
    assert f"d-{rid}" in finished
    return d.worker.get_block_ids_with_load_errors()


def test_with_a_deployment_secret_signed_params_pull_and_widened_ones_are_recomputed(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "a7" * 32)  # both adapters read it at construction
    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-signed", port), seed=1)
    d = Side(make_config(model_dir, "kv_consumer", "D-signed", port), seed=2)
    try:
        victim: dict[str, Any] = {}

        def keep(params: dict[str, Any]) -> dict[str, Any]:
            assert len(params["remote_capability"]) == 64 and params["remote_capability_expires"] > 0
            victim.update(params)
            return params

        assert _pull_once(p, d, "victim", [4, 5, 6, 7], [21, 22, 23], forge=keep) == set()  # control: signed, pulled
        assert [d.block(b) for b in (21, 22, 23)] == [p.block(b) for b in (4, 5, 6)]
        before = [d.block(b) for b in (24, 25, 26)]
        widened = _pull_once(
            p, d, "mine", [8, 9, 10, 11], [24, 25, 26], forge=lambda prm: {**prm, "remote_block_ids": [[4, 5, 6]]}
        )
        assert widened == {24, 25, 26}  # refused: load errors, vLLM recomputes the request
        assert [d.block(b) for b in (24, 25, 26)] == before  # nothing of the victim's blocks landed
    finally:
        d.close()
        p.close()


def test_invalid_config_is_a_typed_error_naming_the_field(model_dir: Path) -> None:
    config = make_config(model_dir, "kv_consumer", "D-bad", 40000, decode={"tp_size": 1, "pp_size": 2})
    with pytest.raises(ConfigError, match=r"decode\.pp_size"):
        MooncakeConnectorV1(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_d_scheduler_waits_for_the_pull_then_recomputes_only_the_last_token(model_dir: Path) -> None:
    """D driven by vLLM's real v1 Scheduler: WAITING_FOR_REMOTE_KVS until the worker reports the pull."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-sched", port), seed=3)
    d_config = make_config(model_dir, "kv_consumer", "D-sched", port)
    kcc = kv_cache_config()
    d_worker = KVConnectorFactory.create_connector(d_config, KVConnectorRole.WORKER, kcc)
    d_caches = {n: torch.zeros(2, NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.float16) for n in LAYERS}
    d_worker.register_kv_caches(d_caches)
    sched = Scheduler(
        vllm_config=d_config,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(d_config),
        block_size=BLOCK,
        log_stats=False,
    )
    try:
        req_p = request("p-req", 40, {"do_remote_decode": True})
        p.sched.update_state_after_alloc(req_p, blocks([4, 5, 6]), 0)
        p.step()
        req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p.sched.request_finished(req_p, [4, 5, 6])
        p.step()
        assert params is not None
        req_d = request("d-req", 40, params, max_tokens=4, hasher=vb.block_hasher(d_config, kcc))
        sched.add_request(req_d)
        out = sched.schedule()
        assert req_d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        d_worker.bind_connector_metadata(out.kv_connector_metadata)
        d_worker.start_load_kv(None)  # type: ignore[arg-type]
        d_worker.clear_connector_metadata()
        done: set[str] = set()
        deadline = time.monotonic() + 20
        while "d-req" not in done and time.monotonic() < deadline:
            done |= d_worker.get_finished(set())[1] or set()
            time.sleep(0.005)
        assert done == {"d-req"} and d_worker.get_block_ids_with_load_errors() == set()
        local = sched.kv_cache_manager.get_block_ids("d-req")[0]
        block = lambda caches, b: b"".join(caches[n][kv, b].numpy().tobytes() for n in LAYERS for kv in (0, 1))  # noqa: E731
        assert [block(d_caches, b) for b in local] == [p.block(b) for b in (4, 5, 6)]
        connector_output = KVConnectorOutput(finished_recving=done)
        sched.update_from_output(
            out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=connector_output)
        )
        out = sched.schedule()
        assert out.num_scheduled_tokens == {"d-req": 1}  # only the last prompt token is recomputed on D
        assert req_d.num_computed_tokens == 40  # 39 loaded from P + the 1 token scheduled now
    finally:
        sched.shutdown()
        d_worker.shutdown()
        p.close()


def test_p_workers_hand_their_address_to_ps_scheduler_through_vllms_handshake_metadata(model_dir: Path) -> None:
    """vLLM gathers each worker's `get_handshake_metadata` and hands them to the scheduler
    (`set_xfer_handshake_metadata_pp_aware`, keyed (pp, tp)): P's params then name the node of each
    port that is not the scheduler's (a P instance spanning nodes); D's workers have none."""
    from ascend_dist.kv_mooncake.pull.vllm_connector import PullRankAddress

    port = free_port_range(2)
    p = Side(make_config(model_dir, "kv_producer", "P-hs", port, host="127.0.0.1"), seed=1)
    d = Side(make_config(model_dir, "kv_consumer", "D-hs", port, host="127.0.0.1"), seed=2)
    try:
        assert p.worker.get_handshake_metadata() == PullRankAddress("127.0.0.1", port)
        assert d.worker.get_handshake_metadata() is None
        d.sched.set_xfer_handshake_metadata_pp_aware({})  # vLLM calls it on D too: nothing to map
        req = request("one-node", 40, {"do_remote_decode": True})
        p.sched.set_xfer_handshake_metadata_pp_aware({(0, 0): p.worker.get_handshake_metadata()})
        p.sched.update_state_after_alloc(req, blocks([4, 5, 6]), 0)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p.sched.request_finished(req, [4, 5, 6])
        assert params is not None and "remote_rank_hosts" not in params  # one node: the params as before
        # A worker on another node (an address that is not this scheduler's host), a stranger's metadata ignored.
        p.sched.set_xfer_handshake_metadata_pp_aware({(0, 0): PullRankAddress("10.9.0.2", port), (0, 1): object()})
        req = request("two-nodes", 40, {"do_remote_decode": True})
        p.sched.update_state_after_alloc(req, blocks([8, 9, 10]), 0)
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        _, params = p.sched.request_finished(req, [8, 9, 10])
        assert params is not None and params["remote_rank_hosts"] == ["10.9.0.2"]
    finally:
        d.close()
        p.close()
