"""MooncakeConnectorV1's transfer stats read back through vLLM 0.33's own stats objects.

A real P/D pair (vLLM's factory, one Mooncake TCP engine on loopback, P's side channel): D's
worker stats go to vLLM's `KVConnectorLogging` (the "KV Transfer metrics" line) and
`KVConnectorProm` (a private Prometheus registry) exactly as vLLM's scheduler hands them on.
"""

from __future__ import annotations

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
from pull_vllm_support import Side, blocks, make_config, request  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.testing.vllm_stats import read_back  # noqa: E402

model_dir = support.model_dir


def _prefill(p: Side, rid: str, block_ids: list[int]) -> dict[str, Any]:
    req = request(rid, 40, {"do_remote_decode": True})
    p.sched.update_state_after_alloc(req, blocks(block_ids), 0)
    p.step()
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = p.sched.request_finished(req, block_ids)
    p.step()
    assert params is not None
    return params


def _pull(d: Side, rid: str, params: dict[str, Any]) -> set[int]:
    req = request(rid, 40, params)
    assert d.sched.get_num_new_matched_tokens(req, 16) == (24, True)
    d.sched.update_state_after_alloc(req, blocks([21, 22]), 24)
    d.step()
    finished: set[str] = set()
    deadline = time.monotonic() + 20
    while rid not in finished and time.monotonic() < deadline:
        finished |= d.worker.get_finished(set())[1] or set()
        time.sleep(0.005)
    assert rid in finished
    return d.worker.get_block_ids_with_load_errors()


@pytest.fixture
def pair(model_dir: Path) -> Any:
    port = free_port_range(1)
    p = Side(make_config(model_dir, "kv_producer", "P-stats", port), seed=1)
    d_config = make_config(model_dir, "kv_consumer", "D-stats", port)
    d = Side(d_config, seed=2)
    try:
        yield p, d, d_config
    finally:
        d.close()
        p.close()


def _payload(side: Side) -> dict[str, Any] | None:
    stats = side.worker.get_kv_connector_stats()
    return None if stats is None else stats.to_dict()


def test_a_pull_shows_its_bytes_time_and_descriptors_in_vllms_log_and_prometheus(pair: Any) -> None:
    p, d, d_config = pair
    assert _payload(d) is None  # control: registration moved nothing, so there is nothing to report
    assert _pull(d, "d-req", _prefill(p, "p-req", [4, 5, 6, 7])) == set()
    assert [d.block(b) for b in (21, 22)] == [p.block(b) for b in (5, 6)]
    payload = _payload(d)
    assert _payload(d) is None  # taken once
    out = read_back(d_config, payload)
    moved = len(d.block(21)) + len(d.block(22))  # every layer's K and V of the two pulled blocks
    assert out.sample("vllm:mooncake_bytes_transferred_sum") == moved
    assert out.sample("vllm:mooncake_bytes_transferred_count") >= 1
    assert out.sample("vllm:mooncake_num_descriptors_sum") >= 1
    assert out.sample("vllm:mooncake_xfer_time_seconds_count") == out.sample("vllm:mooncake_bytes_transferred_count")
    assert out.sample("vllm:mooncake_num_failed_transfers_total", kind="lease_expired") is None
    assert len(out.lines) == 1 and "p2p load: Num successful transfers=" in out.lines[0]
    assert f"p2p load: MB transferred={round(moved / 2**20, 3)}" in out.lines[0]


def test_no_transfer_means_no_metric_and_no_log_line(pair: Any) -> None:
    _, d, d_config = pair
    out = read_back(d_config, _payload(d))
    assert out.lines == []
    assert out.sample("vllm:mooncake_bytes_transferred_sum") is None


def test_a_pull_of_blocks_p_no_longer_holds_counts_as_lease_expired(pair: Any) -> None:
    p, d, d_config = pair
    params = _prefill(p, "p-gone", [4, 5, 6, 7])
    # P let these blocks go (D's DONE already came, or its lease ran out): D asks for a request P no longer holds.
    params["remote_request_id"] = "freed-on-p"
    assert _pull(d, "d-gone", params) == {21, 22}
    out = read_back(d_config, _payload(d))
    assert out.sample("vllm:mooncake_num_failed_transfers_total", kind="lease_expired") == 1
    assert out.sample("vllm:mooncake_bytes_transferred_sum") is None  # nothing was read
    assert "p2p load: Num failed transfers (lease_expired)=1" in out.lines[0]


def test_a_pull_from_a_dead_side_channel_counts_as_timeout(pair: Any) -> None:
    p, d, d_config = pair
    params = _prefill(p, "p-dead", [4, 5, 6, 7])
    params["remote_port"] = free_port_range(1)  # nothing listens there
    assert _pull(d, "d-dead", params) == {21, 22}
    out = read_back(d_config, _payload(d))
    failed = {
        kind: out.sample("vllm:mooncake_num_failed_transfers_total", kind=kind)
        for kind in ("timeout", "peer_unreachable", "refused", "other", "lease_expired")
    }
    assert sum(v or 0 for v in failed.values()) == 1, failed
    assert failed["timeout"] == 1 or failed["peer_unreachable"] == 1, failed
