"""This node's defaults for ``host`` and ``mooncake_protocol`` (`core.node`, issue 22 item 5).

The probes are injected (no NPU or GPU here); the real ones run at the end and in the two-host
tests (`test_pd_netns.py`: a P whose config has no ``host`` advertises its namespace's address).
"""

from __future__ import annotations

import ipaddress
import logging
import os
from typing import Any

import pytest

from ascend_dist.common.errors import ConfigError, DeviceUnavailable
from ascend_dist.kv_mooncake.core.node import (
    HOST_ENV,
    device_protocol,
    interface_addresses,
    node_address,
    route_address,
)
from ascend_dist.kv_mooncake.pull.config import PullConfig

TOPOLOGY = {"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}}


def _nothing() -> None:
    return None


def test_the_node_address_is_vllm_host_ip_then_the_route_then_an_interface() -> None:
    assert node_address({HOST_ENV: "10.1.2.3"}, lambda: "10.9.9.9", lambda: ["10.8.8.8"]) == "10.1.2.3"
    assert node_address({}, lambda: "10.9.9.9", lambda: ["10.8.8.8"]) == "10.9.9.9"
    assert node_address({HOST_ENV: "  "}, _nothing, lambda: ["10.8.8.8", "10.7.7.7"]) == "10.8.8.8"


def test_a_node_without_any_address_falls_back_to_loopback_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ascend_dist.kv_mooncake.core.node"):
        assert node_address({}, _nothing, list) == "127.0.0.1"
    assert "set host in kv_connector_extra_config" in caplog.text


class Probe:
    """Our `BackendProbe` Protocol with fixed answers (no NPU or GPU needed)."""

    def __init__(self, npu: bool, cuda: bool) -> None:
        self._npu, self._cuda = npu, cuda

    def npu(self) -> tuple[bool, str]:
        return self._npu, "fake"

    def cuda(self) -> tuple[bool, str]:
        return self._cuda, "fake"


@pytest.mark.parametrize(
    ("npu", "cuda", "protocol"),
    [(True, False, "ascend"), (True, True, "ascend"), (False, True, "rdma"), (False, False, "tcp")],
)
def test_the_protocol_follows_the_device_runtime(npu: bool, cuda: bool, protocol: str) -> None:
    assert device_protocol({}, Probe(npu, cuda)) == protocol


def test_the_protocol_follows_a_forced_device_backend() -> None:
    """``ASCEND_DIST_DEVICE`` picks the runtime for the device code and so for the transport."""
    assert device_protocol({"ASCEND_DIST_DEVICE": "cuda"}, Probe(True, True)) == "rdma"
    assert device_protocol({"ASCEND_DIST_DEVICE": "cpu"}, Probe(True, True)) == "tcp"
    with pytest.raises(DeviceUnavailable):  # forced onto a device this node does not have: said, not guessed
        device_protocol({"ASCEND_DIST_DEVICE": "cuda"}, Probe(True, False))


def _parse(extra: dict[str, Any]) -> PullConfig:
    return PullConfig.from_kv_transfer_config(engine_id="P0", kv_role="kv_producer", kv_port=36000, extra=extra)


def test_a_config_without_host_advertises_the_node_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_ENV, "10.213.7.9")
    assert _parse(TOPOLOGY).host == "10.213.7.9"
    assert _parse({**TOPOLOGY, "host": "10.0.0.5"}).host == "10.0.0.5"  # control: a set host wins


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "*"])
def test_a_wildcard_node_address_is_refused_naming_host(monkeypatch: pytest.MonkeyPatch, wildcard: str) -> None:
    monkeypatch.setenv(HOST_ENV, wildcard)
    with pytest.raises(ConfigError) as info:
        _parse(TOPOLOGY)
    assert info.value.field == "host"


def test_a_config_without_protocol_takes_this_machines_runtime() -> None:
    """On a machine with neither an NPU nor a CUDA GPU (CI): tcp (with them the probes above pick ascend/rdma)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() or os.environ.get("ASCEND_DIST_DEVICE"):
        pytest.skip("a CUDA GPU is present or the device is forced: the default is not tcp here")
    assert device_protocol() == "tcp"
    assert _parse(TOPOLOGY).protocol == "tcp"
    assert _parse({**TOPOLOGY, "mooncake_protocol": "rdma"}).protocol == "rdma"  # control: a set one wins


def test_the_real_probes_return_specific_addresses_or_nothing() -> None:
    """Never loopback or a wildcard: those would be advertised to peers on other nodes."""
    found = [a for a in (route_address(), *interface_addresses()) if a is not None]
    for address in found:
        ip = ipaddress.ip_address(address)
        assert not ip.is_loopback and not ip.is_unspecified, address
