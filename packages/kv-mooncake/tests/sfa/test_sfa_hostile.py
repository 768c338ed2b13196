"""SfaRemoteD2HConnector under hostile ``kv_transfer_params``, driven by vLLM 0.33.0's real v1 ``Scheduler``.

One hostile request between two good ones, on D (``do_remote_prefill`` + the proxy's ``metaserver``
URL: D's scheduler POSTs its contact info there) and on P (D's contact info: address, TP size,
cached tokens; or a prompt-list child's entry of ``batch_kv_transfer_params``). No exception
escapes, the hostile request is computed locally with exactly one warning naming the key, the good
ones are posted (D) or read (P), and nothing is left behind. The engines are vLLM's ``Scheduler``
alone (no model, no worker).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
pytest.importorskip("vllm")

# First import after the skip: it sets HF_HUB_OFFLINE before torch and vLLM load.
import sfa_vllm_support as _h  # noqa: E402  (configs, KV-cache config)

model_dir = _h.model_dir  # the tiny MLA-like config directory fixture

from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dist.kv_mooncake.sfa.vllm_connector import SfaRemoteD2HConnector  # noqa: E402
from ascend_dist.testing import hostile as hr  # noqa: E402

PROMPT = 40


def good_p(ext_id: str) -> dict[str, Any]:
    """D's contact info as the proxy hands it to P (D at TP 1)."""
    return {
        "request_id": ext_id,
        "remote_engine_id": "D-x",
        "remote_host": "127.0.0.1",
        "remote_port": 40400,
        "remote_tp_size": 1,
        "remote_cached_tokens": 0,
        "do_remote_prefill": False,
        "do_remote_decode": True,
    }


D_GARBAGE = [
    *hr.NOT_A_DICT,
    *hr.METASERVER,
    *hr.flag("do_remote_prefill"),
    *hr.flag("do_virtual"),
    hr.Garbage("decode-flag-on-d", hr.with_(do_remote_decode=True), "do_remote_decode"),
]

P_GARBAGE = [
    *hr.NOT_A_DICT,
    *hr.ENDPOINT,
    *hr.flag("do_remote_decode"),
    hr.Garbage("tp-size-other", hr.with_(remote_tp_size=4096), "remote_tp_size"),
    hr.Garbage("tp-size-missing", hr.without("remote_tp_size"), "remote_tp_size"),
    hr.Garbage("cached-beyond-prompt", hr.with_(remote_cached_tokens=10_000), "remote_cached_tokens"),
    hr.Garbage("request-id-huge", hr.with_(request_id="r" * 100_000), "request_id"),
    hr.Garbage("prefill-flag-on-p", hr.with_(do_remote_prefill=True), "do_remote_prefill"),
    hr.Garbage(
        "batch-without-this-child",
        lambda good: {"do_remote_decode": True, "batch_kv_transfer_params": {"other": good}},
        "batch_kv_transfer_params",
    ),
    hr.Garbage(
        "batch-not-a-dict",
        lambda good: {"do_remote_decode": True, "batch_kv_transfer_params": {"bad": "x"}},
        "kv_transfer_params",
    ),
]


def _tracked(engine: Any) -> int:
    connector = engine.connector
    assert isinstance(connector, SfaRemoteD2HConnector)
    sched = connector._consumer_sched or connector._producer_sched
    assert sched is not None
    return sched.tracked


@pytest.fixture
def metaserver() -> Any:
    server = hr.Metaserver()
    yield server
    server.close()


@pytest.mark.parametrize("garbage", D_GARBAGE, ids=[g.name for g in D_GARBAGE])
def test_d_computes_a_hostile_request_locally(
    model_dir: Path, metaserver: Any, caplog: pytest.LogCaptureFixture, garbage: Any
) -> None:
    d = hr.Engine(_h.make_config(model_dir, "kv_consumer", "D-sfh", 40400), _h.kv_cache_config(), _h.BLOCK)
    try:
        good = {"do_remote_prefill": True, "metaserver": metaserver.url}
        good_a = d.add("good-a", PROMPT, dict(good))
        bad = d.add("bad", PROMPT, garbage.make(dict(good)), first=500)
        good_b = d.add("good-b", PROMPT, dict(good), first=900)
        out = d.schedule()
        hr.assert_one_warning(caplog, garbage.key)
        assert bad.kv_transfer_params is None and out.num_scheduled_tokens == {"bad": PROMPT}
        assert good_a.status == good_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert sorted(r.request_id for r in out.kv_connector_metadata.inner.requests) == ["good-a", "good-b"]
        metaserver.wait_for(["good-a", "good-b"])
        assert "bad" not in metaserver.got  # no contact posted for it
        d.step(out, sampled=["bad"], recving=["good-a", "good-b"])
        out = d.schedule()
        assert out.num_scheduled_tokens == {"good-a": 1, "good-b": 1}
        d.step(out, sampled=["good-a", "good-b"])
        d.assert_idle(lambda: _tracked(d))
        assert len(hr.ascend_warnings(caplog)) == 1
    finally:
        d.close()


@pytest.mark.parametrize("garbage", P_GARBAGE, ids=[g.name for g in P_GARBAGE])
def test_p_computes_a_hostile_request_locally(model_dir: Path, caplog: pytest.LogCaptureFixture, garbage: Any) -> None:
    p = hr.Engine(_h.make_config(model_dir, "kv_producer", "P-sfh", 40400), _h.kv_cache_config(), _h.BLOCK)
    try:
        p.add("good-a", PROMPT, good_p("good-a"))
        bad = p.add("bad", PROMPT, garbage.make(good_p("bad")), first=500)
        p.add("good-b", PROMPT, good_p("good-b"), first=900)
        out = p.schedule()
        hr.assert_one_warning(caplog, garbage.key)
        assert bad.kv_transfer_params is None
        assert out.num_scheduled_tokens == {"good-a": PROMPT, "bad": PROMPT, "good-b": PROMPT}
        assert sorted(s.ext_id for s in out.kv_connector_metadata.inner.requests) == ["good-a", "good-b"]
        p.step(out, sampled=["good-a", "bad", "good-b"])
        assert p.params == {"good-a": None, "bad": None, "good-b": None}
        assert p.free_blocks() == p.free_at_start  # P frees at once (the workers' reuse gates protect)
        p.assert_idle(lambda: _tracked(p))
        assert len(hr.ascend_warnings(caplog)) == 1
    finally:
        p.close()
