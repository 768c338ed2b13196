"""A P instance whose ranks span nodes: P maps each of its ports to its worker's node, signs the map,
and D reads each P rank on its own node (issue 22 item 5; no engine here, the transfer itself is in
`test_pd_netns.py`)."""

from __future__ import annotations

from typing import Any

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.kv_mooncake.core.capability import PULL_PURPOSE, CapabilityRefused, check_capability
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.messages import parse_transfer_params
from ascend_dist.kv_mooncake.pull.scheduler import PullScheduler, SchedRequest
from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta, pull_capability, rank_host

SECRET = DeploymentSecret(b"k" * 32)
KV_PORT = 40000
# P: TP 2 x DP 2; this scheduler is DP rank 1, so its ports are 40002 and 40003.
EXTRA: dict[str, Any] = {"prefill": {"tp_size": 2, "dp_size": 2}, "decode": {"tp_size": 1}, "dp_rank": 1}


def _scheduler(role: str, host: str = "10.0.0.1", secret: DeploymentSecret | None = None) -> PullScheduler:
    config = PullConfig.from_kv_transfer_config(
        engine_id="P" if role == "kv_producer" else "D", kv_role=role, kv_port=KV_PORT, extra={**EXTRA, "host": host}
    )
    return PullScheduler(config, [16], secret=secret)


def _lend(p: PullScheduler, rid: str = "r1") -> dict[str, Any]:
    req = SchedRequest(rid, 40, {"do_remote_decode": True})
    p.update_state_after_alloc(req, [[3, 4, 5]], 0)
    req.length_capped = True
    delay, params = p.request_finished(req, [[3, 4, 5]])
    assert delay and params is not None
    return params


def _d_meta(params: dict[str, Any], secret: DeploymentSecret | None = None) -> ReqMeta:
    d = _scheduler("kv_consumer", host="10.0.0.9", secret=secret)
    req = SchedRequest("d1", 40, dict(params))
    count, _ = d.get_num_new_matched_tokens(req, 0)
    d.update_state_after_alloc(req, [[7, 8, 9]], count)
    return d.build_connector_meta().requests["d1"]


def test_p_names_each_ports_node_when_its_ranks_span_nodes() -> None:
    p = _scheduler("kv_producer")
    p.set_rank_addresses([("10.0.0.1", 40002), ("10.0.0.2", 40003)])
    params = _lend(p)
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.1", 40002)
    assert params["remote_rank_hosts"] == ["", "10.0.0.2"]  # "" = remote_host (the scheduler's node)
    meta = _d_meta(params)
    assert [rank_host(meta, port) for port in (40002, 40003)] == ["10.0.0.1", "10.0.0.2"]


def test_all_ranks_on_the_schedulers_node_leave_the_params_as_before() -> None:
    """The control: one node, or vLLM never handing over handshake metadata -> no new key, one host."""
    p = _scheduler("kv_producer")
    assert "remote_rank_hosts" not in _lend(p, "a")
    p.set_rank_addresses([("10.0.0.1", 40002), ("10.0.0.1", 40003)])
    params = _lend(p, "b")
    assert "remote_rank_hosts" not in params
    meta = _d_meta(params)
    assert [rank_host(meta, port) for port in (40002, 40003)] == ["10.0.0.1", "10.0.0.1"]


def test_ports_of_other_dp_ranks_are_ignored_and_wildcards_refused() -> None:
    p = _scheduler("kv_producer")
    p.set_rank_addresses([("10.0.0.7", 40000), ("10.0.0.2", 40003), ("10.0.0.8", 40004)])
    assert p.rank_hosts == ["", "10.0.0.2"]
    with pytest.raises(ConfigError) as info:
        p.set_rank_addresses([("0.0.0.0", 40003)])
    assert info.value.field == "host"


def test_the_rank_hosts_are_signed_with_the_blocks() -> None:
    """With a deployment secret D refuses params whose rank hosts a client changed (its reads of
    that rank would go to a host of the client's choosing), and accepts them unchanged."""
    p = _scheduler("kv_producer", secret=SECRET)
    p.set_rank_addresses([("10.0.0.1", 40002), ("10.0.0.2", 40003)])
    params = _lend(p)

    def check(meta: ReqMeta) -> None:
        check_capability(SECRET, PULL_PURPOSE, pull_capability(meta), meta.capability, field="f", now_ms=None)

    check(_d_meta(params, SECRET))  # control: as P signed them
    for hosts in (["", "10.6.6.6"], ["10.0.0.2", ""], [], ["", "10.0.0.2", "10.6.6.6"]):
        with pytest.raises(CapabilityRefused):
            check(_d_meta({**params, "remote_rank_hosts": hosts}, SECRET))
    unmapped = {k: v for k, v in params.items() if k != "remote_rank_hosts"}
    with pytest.raises(CapabilityRefused):  # dropping the map sends every rank to remote_host
        check(_d_meta(unmapped, SECRET))


def test_a_bad_rank_host_is_refused_naming_its_index() -> None:
    params = _lend(_scheduler("kv_producer"))
    with pytest.raises(ConfigError) as info:
        parse_transfer_params({**params, "remote_rank_hosts": ["", "tcp://x:1"]})
    assert info.value.field == "kv_transfer_params.remote_rank_hosts[1]"
    with pytest.raises(ConfigError, match="remote_rank_hosts"):
        parse_transfer_params({**params, "remote_rank_hosts": "10.0.0.2"})  # not a list
    with pytest.raises(ConfigError, match="remote_rank_hosts"):
        parse_transfer_params({**params, "remote_rank_hosts": [""] * 5000})  # bounded
