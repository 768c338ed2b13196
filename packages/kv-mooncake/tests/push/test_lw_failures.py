"""Failure paths of the layer-wise push with real processes: each ends in a reported load error or a typed error."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.core.messages import Refused
from ascend_dist.kv_mooncake.push.messages import reply_codec


def _all_blocks(pair: Any, rid: str) -> set[int]:
    return {b for group in pair.d.blocks[rid] for b in group}


@pytest.mark.timeout(60)
def test_p_killed_mid_forward_fails_the_request_within_the_layer_deadline(make_lw_pair: Callable[..., Any]) -> None:
    # The dead P had claimed the request: D holds the failure for fence_timeout_s (P cannot say it ended).
    pair = make_lw_pair(p_procs=True, layers=8, d_extra={"layer_timeout_s": 1.0, "fence_timeout_s": 0.5})
    pair.d.announce("k0", 64)
    params = pair.metaserver.take("k0")
    pair.send_prefill(params, 64, seed=1, compute_s=0.3)
    time.sleep(0.8)  # two or three layers pushed
    pair.own[0].kill()
    start = time.monotonic()
    errors = pair.d.wait_recv({"k0"}, timeout_s=10.0)
    assert errors == _all_blocks(pair, "k0")  # reported finished, every block invalid: vLLM recomputes
    assert time.monotonic() - start < 3.0
    assert "did not arrive" in pair.d.ranks[0].worker.failure_reasons["k0"]
    pair.d.finish("k0")
    assert pair.d.scheduler.tracked == 0


@pytest.mark.timeout(60)
def test_p_that_never_pushes_fails_after_the_first_layer_deadline(make_lw_pair: Callable[..., Any]) -> None:
    pair = make_lw_pair(d_extra={"first_layer_timeout_s": 0.5})
    pair.d.announce("n0", 40)
    pair.metaserver.take("n0")  # the proxy never forwards it
    assert pair.d.wait_recv({"n0"}, timeout_s=5.0) == _all_blocks(pair, "n0")


@pytest.mark.timeout(60)
def test_failed_announcement_reports_the_request_finished_with_its_blocks(make_lw_pair: Callable[..., Any]) -> None:
    pair = make_lw_pair(fail_announce="proxy down")
    pair.d.announce("a0", 40)
    deadline = time.monotonic() + 5.0
    errors: set[int] = set()
    done: set[str] = set()
    while "a0" not in done and time.monotonic() < deadline:
        pair.d.step()  # the failure reaches the workers with the next step's metadata
        got, errs = pair.d.poll()
        done |= got
        errors |= errs
        time.sleep(0.01)
    assert "a0" in done and errors == _all_blocks(pair, "a0")
    assert "proxy down" in pair.d.ranks[0].worker.failure_reasons["a0"]


@pytest.mark.timeout(60)
def test_incompatible_p_is_refused_and_d_learns_of_it_at_once(make_lw_pair: Callable[..., Any]) -> None:
    """P serves another model: D refuses GetMeta naming the field; P's FAILED reaches D before any deadline."""
    pair = make_lw_pair(p_extra={"model": "another-model"}, d_extra={"first_layer_timeout_s": 30.0})
    pair.d.announce("c0", 40)
    params = pair.metaserver.take("c0")
    start = time.monotonic()
    pair.send_prefill(params, 40, seed=1)
    pair.read_prefill()
    assert pair.d.wait_recv({"c0"}, timeout_s=5.0) == _all_blocks(pair, "c0")
    assert time.monotonic() - start < 5.0
    assert "model differs" in pair.d.ranks[0].worker.failure_reasons["c0"]
    assert pair.p_idle() == [0]


@pytest.mark.timeout(60)
def test_malformed_messages_are_dropped_and_d_keeps_serving(make_lw_pair: Callable[..., Any]) -> None:
    pair = make_lw_pair()
    port = pair.d.ranks[0].worker.handshake_port
    with RpcClient(timeout_s=1.0, retries=1) as client:
        reply = reply_codec(1 << 20).decode(client.request(tcp_endpoint("127.0.0.1", port), b"\x93garbage"))
    assert reply == Refused(field="message")  # answered with a refusal, not an error frame
    assert pair.transfer("g0", 50, seed=3) == set()
    assert pair.d.verify("g0", 3) > 0


@pytest.mark.timeout(60)
def test_unreachable_d_does_not_hang_p(make_lw_pair: Callable[..., Any]) -> None:
    """P pushes to a D port nobody serves: the forward completes in bounded time and P frees everything."""
    pair = make_lw_pair()
    pair.d.announce("u0", 40)
    params = {**pair.metaserver.take("u0"), "remote_port": pair.extra["kv_port"] + 7}
    start = time.monotonic()
    pair.send_prefill(params, 40, seed=1)
    pair.read_prefill(timeout_s=20.0)
    assert pair.p_idle() == [0]
    assert time.monotonic() - start < 10.0


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"prefill": {"tp_size": 1}, "decode": {"tp_size": 2}}, "decode.tp_size"),
        ({"prefill": {"tp_size": 2, "pp_size": 2}, "decode": {"tp_size": 1}}, "prefill.pp_size"),
        ({"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "layer_timeout_s": 0}, "layer_timeout_s"),
        ({"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "host": "0.0.0.0"}, "host"),
        (
            {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "tls_config": {"ssl_enable": "yes"}},
            "tls_config.ssl_enable",
        ),
        ({"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "tls_config": {"verify": False}}, "tls_config.verify"),
        ({"prefill": {"tp_size": 1}}, "kv_connector_extra_config.decode"),
        ({"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "mooncake_protocol": "udp"}, "mooncake_protocol"),
    ],
)
def test_invalid_config_names_the_field(extra: dict[str, Any], field: str) -> None:
    from ascend_dist.kv_mooncake.push.config import LayerwiseConfig

    with pytest.raises(ConfigError) as info:
        LayerwiseConfig.from_kv_transfer_config(engine_id="e", kv_role="kv_consumer", kv_port=40000, extra=extra)
    assert info.value.field == field
