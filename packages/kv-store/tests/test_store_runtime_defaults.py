"""Backend settings the runtime decides: Mooncake's node address and protocol, openYuanrong's memory kind."""

from __future__ import annotations

import socket

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_store.backends.factory import create_backend
from ascend_dist.kv_store.config.config import MooncakeStoreConfig, YuanrongConfig


def _node_address() -> str | None:
    """A non-loopback IPv4 address of this host, read per interface (SIOCGIFADDR), not by routing."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            addr = socket.inet_ntoa(raw[20:24])
            if not addr.startswith("127."):
                return addr
    return None


def test_local_hostname_is_the_address_that_routes_to_the_master() -> None:
    node = _node_address()
    if node is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    cfg = MooncakeStoreConfig.load({"master_server_address": f"{node}:50051", "protocol": "tcp"}, env={})
    assert cfg.local_hostname == node  # was 127.0.0.1: other nodes would dial their own loopback
    loop = MooncakeStoreConfig.load({"master_server_address": "127.0.0.1:50051", "protocol": "tcp"}, env={})
    assert loop.local_hostname == "127.0.0.1"  # control: a loopback master is reached from loopback
    explicit = {"master_server_address": f"{node}:50051", "protocol": "tcp", "local_hostname": "10.9.8.7"}
    assert MooncakeStoreConfig.load(explicit, env={}).local_hostname == "10.9.8.7"  # an explicit setting wins


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_node_address_is_refused(wildcard: str) -> None:
    with pytest.raises(ConfigError, match="local_hostname"):
        MooncakeStoreConfig.load(
            {"master_server_address": "127.0.0.1:50051", "protocol": "tcp", "local_hostname": wildcard}, env={}
        )


def test_an_unroutable_master_is_a_config_error_naming_local_hostname() -> None:
    with pytest.raises(ConfigError, match="local_hostname"):
        MooncakeStoreConfig.load(
            {"master_server_address": "no-such-host.invalid:50051", "protocol": "tcp"}, env={}, memory_kind="cpu"
        )


@pytest.mark.parametrize(("kind", "protocol"), [("npu", "ascend"), ("cpu", "tcp"), ("cuda", "tcp")])
def test_protocol_defaults_from_the_device_runtime(kind: str, protocol: str) -> None:
    cfg = MooncakeStoreConfig.load({"master_server_address": "127.0.0.1:50051"}, env={}, memory_kind=kind)
    assert cfg.protocol == protocol
    explicit = MooncakeStoreConfig.load(
        {"master_server_address": "127.0.0.1:50051", "protocol": "rdma"}, env={}, memory_kind=kind
    )
    assert explicit.protocol == "rdma"  # an explicit setting wins


def test_protocol_default_detects_this_process_runtime() -> None:
    cfg = MooncakeStoreConfig.load({"master_server_address": "127.0.0.1:50051"}, env={"ASCEND_DIST_DEVICE": "cpu"})
    assert cfg.protocol == "tcp"


@pytest.mark.parametrize("kind", ["npu", "cuda"])
def test_yuanrong_refuses_device_memory_at_start(kind: str, kvtools) -> None:
    """The KV client copies through host pointers: device KV caches would crash the first save."""
    cfg = {"worker_addr": f"127.0.0.1:{kvtools.free_port()}", "connect_timeout_ms": 300}
    with pytest.raises(ConfigError, match=f"yuanrong.*{kind}") as info:
        create_backend("yuanrong", backend_config=cfg, memory_kind=kind)
    assert info.value.field == "backend"


def test_yuanrong_host_memory_is_accepted(yuanrong_worker) -> None:
    backend = create_backend("yuanrong", backend_config={"worker_addr": yuanrong_worker.address}, memory_kind="cpu")
    try:
        assert backend.exists(["absent-key"]) == [0]
    finally:
        backend.close()


def test_yuanrong_config_still_loads_without_a_runtime() -> None:
    assert YuanrongConfig.load({"worker_addr": "127.0.0.1:31501"}).port == 31501
