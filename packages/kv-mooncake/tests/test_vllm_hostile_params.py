"""MooncakeConnectorV1 under hostile ``kv_transfer_params``, driven by vLLM 0.33.0's real v1 ``Scheduler``.

In ``vllm serve`` a request's ``kv_transfer_params`` come from any client. Each test puts one hostile
request between two good ones and checks that no exception escapes, the hostile request is computed
locally (D: vLLM schedules its whole prompt itself; P: its blocks are freed at once and no params are
returned), exactly one warning names the key, the good requests still get their transfer, and
nothing is left behind (no request, every block back, the connector tracks nothing).

The D and P engines here are vLLM's ``Scheduler`` alone (no model, no worker): the good pulls are
reported done by the test. The last test runs D's worker against a real P (Mooncake TCP, loopback)
with a hostile request naming a port where nothing listens: it fails fast and vLLM recomputes it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
pytest.importorskip("vllm")

# First import after the skip: it sets HF_HUB_OFFLINE before torch and vLLM load.
import pull_vllm_support as _h  # noqa: E402  (configs, the P side, requests)

model_dir = _h.model_dir  # the tiny-llama config directory fixture

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.core.messages import prompt_digest  # noqa: E402
from ascend_dist.kv_mooncake.pull.vllm_connector import MooncakeConnectorV1  # noqa: E402
from ascend_dist.testing import hostile as hr  # noqa: E402

PROMPT = 40  # tokens: 3 blocks of 16


def good_d(port: int = 40100, ids: list[int] | None = None, first: int = 100) -> dict[str, Any]:
    """What P returns for a 40-token prompt (as the proxy forwards it, vLLM's extra key included)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "P-x",
        "remote_request_id": "p-req",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": [ids or [4, 5, 6]],
        "remote_ptp_size": 1,
        "remote_block_size": 16,
        "num_prompt_blocks": 3,
        "remote_window_blocks": [0],
        "remote_state_groups": [],
        "remote_prefill_cached_tokens": 0,
        # P binds its params to the prompt it computed (the harness's ``first..first+PROMPT``).
        "remote_prompt_tokens": PROMPT,
        "remote_prompt_digest": prompt_digest(range(first, first + PROMPT)),
    }


D_GARBAGE = [
    *hr.NOT_A_DICT,
    *hr.ENDPOINT,
    *hr.BLOCK_IDS,
    *hr.flag("do_remote_prefill"),
    hr.Garbage("decode-flag-on-d", hr.with_(do_remote_decode=True), "do_remote_decode"),
    hr.Garbage("engine-id-huge", hr.with_(remote_engine_id="e" * 100_000), "remote_engine_id"),
    hr.Garbage("request-id-missing", hr.without("remote_request_id"), "remote_request_id"),
    hr.Garbage("ptp-size-other", hr.with_(remote_ptp_size=4096), "remote_ptp_size"),
    hr.Garbage("tokens-nan", hr.with_(num_computed_tokens=float("nan")), "num_computed_tokens"),
    hr.Garbage("block-size-negative", hr.with_(remote_block_size=-16), "remote_block_size"),
    # Well-formed params of another prompt (replayed by a client, or copied from someone else's request).
    hr.Garbage("params-of-another-prompt", lambda good: good_d(), "remote_prompt_digest"),
    hr.Garbage("digest-missing", hr.without("remote_prompt_digest"), "remote_prompt_digest"),
    hr.Garbage("digest-not-a-str", hr.with_(remote_prompt_digest=12), "remote_prompt_digest"),
    hr.Garbage("prompt-tokens-beyond-prompt", hr.with_(remote_prompt_tokens=PROMPT + 1), "remote_prompt_tokens"),
]

P_GARBAGE = [
    *hr.NOT_A_DICT,
    *hr.flag("do_remote_decode"),
    hr.Garbage("prefill-flag-on-p", lambda good: good_d(), "do_remote_prefill"),
    hr.Garbage("port-abc", hr.with_(remote_port="abc"), "remote_port"),
    hr.Garbage("engine-id-huge", hr.with_(remote_engine_id="e" * 100_000), "remote_engine_id"),
    hr.Garbage("ids-nested-deep", hr.with_(remote_block_ids=[[[[[1]]]]]), "remote_block_ids"),
]


def _engine(model_dir: Path, role: str, **extra: Any) -> Any:
    config = _h.make_config(model_dir, role, f"{role}-hostile", 40100, **extra)
    return hr.Engine(config, _h.kv_cache_config(), _h.BLOCK)


def _tracked(engine: Any) -> int:
    connector = engine.connector
    assert isinstance(connector, MooncakeConnectorV1) and connector._scheduler is not None
    return connector._scheduler.tracked


@pytest.mark.parametrize("garbage", D_GARBAGE, ids=[g.name for g in D_GARBAGE])
def test_d_computes_a_hostile_request_locally(model_dir: Path, caplog: pytest.LogCaptureFixture, garbage: Any) -> None:
    d = _engine(model_dir, "kv_consumer")
    try:
        good_a = d.add("good-a", PROMPT, good_d())
        bad = d.add("bad", PROMPT, garbage.make(good_d(first=500)), first=500)
        good_b = d.add("good-b", PROMPT, good_d(ids=[7, 8, 9], first=900), first=900)
        out = d.schedule()
        hr.assert_one_warning(caplog, garbage.key)
        assert bad.kv_transfer_params is None and bad.status == RequestStatus.RUNNING
        assert out.num_scheduled_tokens == {"bad": PROMPT}  # all of its prompt, computed here
        assert good_a.status == good_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        pulls = out.kv_connector_metadata.inner.requests
        assert sorted(pulls) == ["good-a", "good-b"] and pulls["good-b"].remote_block_ids == [[7, 8, 9]]
        d.step(out, sampled=["bad"], recving=["good-a", "good-b"])
        out = d.schedule()
        assert out.num_scheduled_tokens == {"good-a": 1, "good-b": 1}  # loaded: the last token is recomputed
        d.step(out, sampled=["good-a", "good-b"])
        assert set(d.params) == {"good-a", "bad", "good-b"} and d.params["bad"] is None
        d.assert_idle(lambda: _tracked(d))
        assert len(hr.ascend_warnings(caplog)) == 1
    finally:
        d.close()


@pytest.mark.parametrize("garbage", P_GARBAGE, ids=[g.name for g in P_GARBAGE])
def test_p_frees_a_hostile_request_at_once(model_dir: Path, caplog: pytest.LogCaptureFixture, garbage: Any) -> None:
    p = _engine(model_dir, "kv_producer")
    try:
        good = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "aborted_request": []}
        p.add("good-a", PROMPT, dict(good))
        bad = p.add("bad", PROMPT, garbage.make(dict(good)), first=500)
        p.add("good-b", PROMPT, dict(good), first=900)
        out = p.schedule()
        hr.assert_one_warning(caplog, garbage.key)
        assert bad.kv_transfer_params is None
        assert out.num_scheduled_tokens == {"good-a": PROMPT, "bad": PROMPT, "good-b": PROMPT}
        p.step(out, sampled=["good-a", "bad", "good-b"])
        assert p.params["bad"] is None  # nothing handed to any D
        for rid in ("good-a", "good-b"):
            assert p.params[rid] is not None and len(p.params[rid]["remote_block_ids"][0]) == 3
        assert p.free_blocks() == p.free_at_start - 2 * 3  # only the good requests' blocks wait for D
        p.step(p.schedule(), sending=["good-a", "good-b"])  # D pulled them
        p.assert_idle(lambda: _tracked(p))
        assert len(hr.ascend_warnings(caplog)) == 1
    finally:
        p.close()


def test_unknown_keys_are_ignored_and_each_logged_once(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = _engine(model_dir, "kv_consumer")
    try:
        odd = {**good_d(), "surprise": "x" * 100_000}
        a = d.add("good-a", PROMPT, odd)
        b = d.add("good-b", PROMPT, {**good_d(first=900), "surprise": "x" * 100_000}, first=900)
        out = d.schedule()
        assert a.status == b.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # the pulls go ahead
        messages = hr.ascend_warnings(caplog)
        assert len(messages) == 1 and "surprise" in messages[0] and len(messages[0]) < 300
        d.step(out, recving=["good-a", "good-b"])
        d.step(d.schedule(), sampled=["good-a", "good-b"])
        d.assert_idle(lambda: _tracked(d))
    finally:
        d.close()


def test_hooks_called_without_on_new_request_still_log_once(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A caller that skips ``on_new_request``: the side-effect-free hook stays silent, the next one drops."""
    config = _h.make_config(model_dir, "kv_consumer", "D-direct", 40100)
    d = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, _h.kv_cache_config())
    try:
        req = _h.request("bad", PROMPT, hr.with_(remote_port="abc")(good_d()))
        assert d.get_num_new_matched_tokens(req, 0) == (0, False)
        assert d.get_num_new_matched_tokens(req, 0) == (0, False)
        assert hr.ascend_warnings(caplog) == [] and req.kv_transfer_params is not None  # no side effect
        d.update_state_after_alloc(req, _h.blocks([]), 0)
        assert d.request_finished(req, []) == (False, None)
        hr.assert_one_warning(caplog, "remote_port")
        assert req.kv_transfer_params is None and d._scheduler.tracked == 0
    finally:
        d.shutdown()


def test_d_dead_peer_fails_fast_and_is_recomputed(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Valid-looking params naming a port where nothing listens: the pull fails fast, vLLM recomputes."""
    port = free_port_range(1)
    fast = {"rpc_timeout_s": 0.3, "rpc_retries": 1}
    p = _h.Side(_h.make_config(model_dir, "kv_producer", "P-dead", port, **fast), seed=11)
    config = _h.make_config(model_dir, "kv_consumer", "D-dead", port, **fast)
    config.kv_transfer_config.kv_load_failure_policy = "recompute"
    kcc = _h.kv_cache_config()
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
    caches = {n: torch.zeros(2, _h.NUM_BLOCKS, _h.BLOCK, 2, 16, dtype=torch.float16) for n in _h.LAYERS}
    worker.register_kv_caches(caches)
    d = hr.Engine(config, kcc, _h.BLOCK)
    try:
        params = {}
        for rid, ids, first in (("p-a", [4, 5, 6], 100), ("p-b", [8, 9, 10], 900)):
            req_p = _h.request(rid, PROMPT, {"do_remote_decode": True}, first=first)
            p.sched.update_state_after_alloc(req_p, _h.blocks(ids), 0)
            p.step()
            req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
            params[rid] = p.sched.request_finished(req_p, ids)[1]
            p.step()
        dead = {
            **params["p-a"],
            "remote_port": free_port_range(1),
            "remote_request_id": "nobody",
            "remote_prompt_digest": prompt_digest(range(500, 500 + PROMPT)),
        }
        d.add("good-a", PROMPT, params["p-a"])
        d.add("dead", PROMPT, dead, first=500)
        d.add("good-b", PROMPT, params["p-b"], first=900)
        out = d.schedule()
        assert out.num_scheduled_tokens == {}  # all three wait for their pulls
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        worker.clear_connector_metadata()
        done: set[str] = set()
        errors: set[int] = set()
        started = time.monotonic()
        while done != {"good-a", "dead", "good-b"} and time.monotonic() - started < 20:
            errors |= worker.get_block_ids_with_load_errors()
            done |= worker.get_finished(set())[1] or set()
            time.sleep(0.005)
        errors |= worker.get_block_ids_with_load_errors()
        assert done == {"good-a", "dead", "good-b"} and time.monotonic() - started < 5  # no stall
        assert errors == set(d.sched.kv_cache_manager.get_block_ids("dead")[0])  # exactly the dead one's
        block = lambda c, b: b"".join(c[n][kv, b].numpy().tobytes() for n in _h.LAYERS for kv in (0, 1))  # noqa: E731
        for rid, ids in (("good-a", [4, 5, 6]), ("good-b", [8, 9, 10])):
            local = d.sched.kv_cache_manager.get_block_ids(rid)[0]
            assert [block(caches, b) for b in local] == [p.block(b) for b in ids]
        d.step(out, recving=done, invalid=errors)
        out = d.schedule()
        assert out.num_scheduled_tokens == {"good-a": 1, "dead": PROMPT, "good-b": 1}  # the dead one recomputed
        d.step(out, sampled=["good-a", "dead", "good-b"])
        d.assert_idle(lambda: _tracked(d))
    finally:
        d.close()
        worker.shutdown()
        p.close()
