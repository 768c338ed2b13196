"""Backend client settings: ``mooncake.json`` / ``MOONCAKE_*`` and the openYuanrong JSON.

Runs in: worker processes (and the scheduler's client), at construction time. Pure apart from
reading the named files; every bad value raises `ConfigError` naming the key. Re-exported by
`ascend_dist.kv_store.config.config`, which holds the connector's own keys.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ascend_dist.common.errors import ConfigError, format_allowed
from ascend_dist.common.units import parse_byte_size

__all__ = [
    "MOONCAKE_PROTOCOLS",
    "MooncakeStoreConfig",
    "YuanrongConfig",
    "default_protocol",
    "int_setting",
    "route_address",
    "runtime_memory_kind",
]

MOONCAKE_PROTOCOLS: Final = ("tcp", "rdma", "ascend")


def runtime_memory_kind(env: Mapping[str, str] | None = None) -> str:
    """Where this process's KV caches live: the device runtime's backend (``npu``, ``cuda`` or ``cpu``).

    Raises:
        ConfigError: ``ASCEND_DIST_DEVICE`` names an unknown backend.
        DeviceUnavailable: ``ASCEND_DIST_DEVICE`` names a hardware backend that cannot be used.
    """
    from ascend_dist.common.device.detect import select_backend  # probes torch: only when asked

    return select_backend(env).name


def default_protocol(memory_kind: str) -> str:
    """Mooncake's transport for KV caches of ``memory_kind``: ``ascend`` on NPU memory, else ``tcp``."""
    return "ascend" if memory_kind == "npu" else "tcp"


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return not host.strip("[]")  # a name is fine; an empty string is no address


def route_address(master: str) -> str:
    """This node's address on the interface that routes to ``master`` (``host:port``).

    A UDP ``connect`` only picks the route and source address; it sends nothing.

    Raises:
        ConfigError: The master's host does not resolve or no route leads to it (names
            ``local_hostname``, which then has to be set).
    """
    host, port = _host_port("master_server_address", master)
    host = host.strip("[]")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(addr)
            local = str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            "local_hostname", None, f"set explicitly: no route from this node to the master {master} ({exc})"
        ) from exc
    if _is_wildcard(local):
        raise ConfigError("local_hostname", local, f"set explicitly: the route to the master {master} has no address")
    return local


def int_setting(extra: Mapping[str, object], key: str, default: int, *, low: int = 0) -> int:
    """``extra[key]`` as an int >= ``low`` (digit strings accepted).

    Raises:
        ConfigError: Another value, naming ``key``.
    """
    value = extra.get(key, default)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(key, value, f"an integer >= {low}")
    return value


def _config_data(
    source: str | os.PathLike[str] | Mapping[str, object] | None,
    env: Mapping[str, str],
    env_var: str,
    what: str,
    label: str,
) -> dict[str, object]:
    """A backend's settings: ``source`` itself (a mapping), the JSON file it names, or the one ``env_var`` names."""
    if source is None:
        path = env.get(env_var)
        if not path:
            raise ConfigError(env_var, path, f"the path of {what}")
        return _read_json(path, env_var)
    if isinstance(source, Mapping):
        return dict(source)
    return _read_json(source, label)


def _read_json(path: str | os.PathLike[str], key: str) -> dict[str, object]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(key, str(path), f"a readable JSON file ({exc.strerror})") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(key, str(path), f"a JSON file ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise ConfigError(key, str(path), "a JSON file holding an object")
    return data


def _str(data: Mapping[str, object], key: str, default: str | None) -> str:
    value = data.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        raise ConfigError(key, value, "a non-empty string" if default is None else "a string")
    return value


def _host_port(key: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, value, "'host:port' with a port in 1..65535")
    return host, int(port)


def _protocol(data: Mapping[str, object], env: Mapping[str, str], memory_kind: str | None) -> str:
    if "protocol" in data:
        return _str(data, "protocol", None).lower()
    return default_protocol(runtime_memory_kind(env) if memory_kind is None else memory_kind)


@dataclass(frozen=True, kw_only=True)
class MooncakeStoreConfig:
    """Settings of the Mooncake Store client (``mooncake.json`` keys)."""

    metadata_server: str = "P2PHANDSHAKE"
    master_server_address: str
    protocol: str = "tcp"  # `load` defaults it from the device runtime (`default_protocol`)
    device_name: str = ""
    local_hostname: str = "127.0.0.1"  # `load` defaults it to the address that routes to the master
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 1 << 30
    preferred_segment: bool = False
    prefer_alloc_in_same_node: bool = True
    enable_ssd_offload: bool = False  # Mooncake >= 0.3.11: spill to <ssd_offload_path>/rank_<global rank>
    ssd_offload_path: str = ""
    fabric_mem: bool = False  # ASCEND_ENABLE_USE_FABRIC_MEM=1 (A3): no local buffer, 1 GiB-aligned segments

    @classmethod
    def load(
        cls,
        source: str | os.PathLike[str] | Mapping[str, object] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        memory_kind: str | None = None,
        route: Callable[[str], str] = route_address,
    ) -> MooncakeStoreConfig:
        """Read the configuration from a mapping, a JSON file or ``MOONCAKE_CONFIG_PATH``.

        Unset ``protocol`` and ``local_hostname`` come from the runtime: ``ascend`` on NPU memory
        (``tcp`` otherwise) and this node's address on the route to the master. Upstream's fixed
        ``127.0.0.1`` made every other node dial its own loopback; explicit settings win.

        Args:
            source: A mapping of ``mooncake.json`` keys, a path, or None to use the environment.
            env: The environment (defaults to ``os.environ``); ``MOONCAKE_MASTER`` and
                ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` override the file.
            memory_kind: Where the KV caches live (``npu``, ``cuda``, ``cpu``); None asks the
                device runtime (`runtime_memory_kind`), only when ``protocol`` is unset.
            route: Finds this node's address towards the master (`route_address`).

        Returns:
            The validated configuration.

        Raises:
            ConfigError: No source, an unreadable file, a missing ``master_server_address``, a bad
                size (``global_segment_size``/``local_buffer_size``), an unknown ``protocol``, SSD
                offload without an absolute ``ssd_offload_path``, a fabric-memory segment that
                is not a multiple of 1 GiB, or a wildcard or underivable ``local_hostname``.
        """
        env = os.environ if env is None else env
        data = _config_data(source, env, "MOONCAKE_CONFIG_PATH", "a mooncake.json file", "mooncake config path")
        master = env.get("MOONCAKE_MASTER") or data.get("master_server_address")
        if not isinstance(master, str) or not master:
            raise ConfigError("master_server_address", master, "'host:port' of mooncake_master (or MOONCAKE_MASTER)")
        _host_port("master_server_address", master)
        segment_src = env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE") or data.get("global_segment_size", 1 << 30)
        protocol = _protocol(data, env, memory_kind)
        if protocol not in MOONCAKE_PROTOCOLS:
            raise ConfigError("protocol", protocol, format_allowed(MOONCAKE_PROTOCOLS))
        for flag in ("preferred_segment", "prefer_alloc_in_same_node", "enable_ssd_offload"):
            if flag in data and not isinstance(data[flag], bool):
                raise ConfigError(flag, data[flag], "a bool")
        ssd = bool(data.get("enable_ssd_offload", False))
        ssd_path = _str(data, "ssd_offload_path", "")
        if ssd and not os.path.isabs(ssd_path):
            raise ConfigError("ssd_offload_path", ssd_path, "an absolute directory (required with enable_ssd_offload)")
        fabric = env.get("ASCEND_ENABLE_USE_FABRIC_MEM", "") == "1"
        segment = parse_byte_size(segment_src, field="global_segment_size")  # type: ignore[arg-type]
        if fabric and segment % (1 << 30):
            raise ConfigError("global_segment_size", segment, "a multiple of 1 GiB with ASCEND_ENABLE_USE_FABRIC_MEM=1")
        local_buffer = parse_byte_size(data.get("local_buffer_size", 1 << 30), field="local_buffer_size")  # type: ignore[arg-type]
        hostname = _str(data, "local_hostname", "") if "local_hostname" in data else route(master)
        if _is_wildcard(hostname):  # other nodes dial it to reach our segment: a wildcard reaches no one
            raise ConfigError("local_hostname", hostname, "this node's address (never a wildcard or empty)")
        return cls(
            metadata_server=_str(data, "metadata_server", "P2PHANDSHAKE"),
            master_server_address=master,
            protocol=protocol,
            device_name=_str(data, "device_name", ""),
            local_hostname=hostname,
            global_segment_size=segment,
            local_buffer_size=0 if fabric else local_buffer,  # fabric memory needs no staging buffer
            preferred_segment=bool(data.get("preferred_segment", False)),
            prefer_alloc_in_same_node=bool(data.get("prefer_alloc_in_same_node", True)),
            enable_ssd_offload=ssd,
            ssd_offload_path=ssd_path,
            fabric_mem=fabric,
        )


@dataclass(frozen=True, kw_only=True)
class YuanrongConfig:
    """Settings of the openYuanrong datasystem client (``YR_CONFIG_PATH`` JSON)."""

    host: str
    port: int
    connect_timeout_ms: int = 9000
    request_timeout_ms: int = 0

    @classmethod
    def load(
        cls,
        source: str | os.PathLike[str] | Mapping[str, object] | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> YuanrongConfig:
        """Read the configuration from a mapping, a JSON file or ``YR_CONFIG_PATH``.

        Raises:
            ConfigError: No source, a file that is not a JSON object, or a ``worker_addr`` that is
                not ``host:port``.
        """
        env = os.environ if env is None else env
        data = _config_data(source, env, "YR_CONFIG_PATH", "the openYuanrong JSON config", "yuanrong config path")
        host, port = _host_port("worker_addr", _str(data, "worker_addr", ""))
        return cls(
            host=host,
            port=port,
            connect_timeout_ms=int_setting(data, "connect_timeout_ms", 9000, low=1),
            request_timeout_ms=int_setting(data, "request_timeout_ms", 0),
        )
