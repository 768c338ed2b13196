"""Pool configuration: ``kv_connector_extra_config`` keys and the backend files/environment.

Runs in: scheduler and worker processes, at construction time. Pure apart from reading the named
configuration files. Every bad value raises `ConfigError` naming the key and the allowed values,
before any resource is taken.

Sources, in order of precedence (spec kv-store.md §2):

* ``kv_connector_extra_config`` (`PoolConfig.from_extra`);
* Mooncake: the JSON file at ``MOONCAKE_CONFIG_PATH`` (or an explicit path / mapping), overridden by
  ``MOONCAKE_MASTER`` and ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (`MooncakeStoreConfig.load`);
* openYuanrong: the JSON file at ``YR_CONFIG_PATH`` (`YuanrongConfig.load`).

Sizes accept ``ascend_dist.common.units`` byte strings (``"1GB"``, ``"512 MiB"``, ``1024``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ascend_dist.common.errors import ConfigError, format_allowed
from ascend_dist.common.log import log_once
from ascend_dist.common.units import parse_byte_size
from ascend_dist.kv_store.worker_types import LayerwiseOptions

__all__ = [
    "BACKENDS",
    "MOONCAKE_PROTOCOLS",
    "ROLES",
    "MooncakeStoreConfig",
    "PoolConfig",
    "YuanrongConfig",
]

BACKENDS: Final = ("mooncake", "memcache", "yuanrong")
ROLES: Final = ("kv_producer", "kv_consumer", "kv_both")
MOONCAKE_PROTOCOLS: Final = ("tcp", "rdma", "ascend")
_KNOWN_EXTRA: Final = frozenset(
    {
        "backend",
        "store_config",
        "lookup_rpc_port",
        "mooncake_rpc_port",
        "lookup_timeout_s",
        "load_async",
        "use_layerwise",
        "consumer_is_to_put",
        "consumer_is_to_load",
        "save_decode_cache",
        "discard_partial_chunks",
        "prefill_pp_size",
        "prefill_pp_layer_partition",
        "prefill_tp_size",
        "decode_tp_size",
        "h2d_stagger_us",
        "layerwise_max_transfer_blocks",
        "layerwise_max_transfer_bytes",
        "layerwise_prefetch_layers",
        "layerwise_num_shared_buffers",
        "layerwise_independent_layers",
        "layerwise_attention_gate",
    }
)


def _bool(extra: Mapping[str, object], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ConfigError(key, value, "a bool (true/false)")


def _int(extra: Mapping[str, object], key: str, default: int, *, low: int = 0) -> int:
    value = extra.get(key, default)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(key, value, f"an integer >= {low}")
    return value


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """The pool settings read from ``kv_connector_extra_config`` plus the vLLM ``kv_role``."""

    backend: str = "mooncake"
    kv_role: str = "kv_both"
    lookup_rpc_port: int = 0
    lookup_timeout_s: float = 1.0
    load_async: bool = False
    use_layerwise: bool = False
    consumer_is_to_put: bool = False
    consumer_is_to_load: bool = False
    save_decode_cache: bool = False
    discard_partial_chunks: bool = True
    kv_events: bool = False
    layerwise_prefetch_layers: int = 1  # from_extra: 8 with memcache (the GVA path), else 1
    layerwise_attention_gate: bool = False
    h2d_stagger_us: int = 0
    layerwise_max_transfer_blocks: int = 0
    layerwise_max_transfer_bytes: int = 0
    layerwise_num_shared_buffers: int = 0  # 0 = one buffer per layer (no reuse)
    layerwise_independent_layers: tuple[int, ...] | str = (0,)
    prefill_tp_size: int = 0  # peer TP read by a kv_consumer (0 = same as local)
    decode_tp_size: int = 0  # peer TP read by a producer / kv_both (0 = same as local)
    prefill_pp_size: int = 1  # a kv_consumer keys its chunks for a prefill with this many PP stages
    prefill_pp_layer_partition: str | None = None  # layers per prefill stage, e.g. "31,30"

    @property
    def peer_tp_size(self) -> int:
        """The other side's TP size for TP-mismatch keys (0 = same as local)."""
        return self.prefill_tp_size if self.is_consumer else self.decode_tp_size

    @property
    def async_loads(self) -> bool:
        """Loads run on the receiving thread (``load_async``; layer-wise loads are never async)."""
        return self.load_async and not self.use_layerwise

    def for_groups(self, num_groups: int) -> PoolConfig:
        """This config with the load mode vLLM can recover from for a model with ``num_groups`` KV groups.

        One group: unchanged (a failed block is reported by id, sync or async). Several groups:
        vLLM 0.33 takes their load failures only per request, from async loads, so ``load_async``
        is turned on (logged once at INFO); layer-wise loads, which are synchronous, are refused.

        Raises:
            ConfigError: ``use_layerwise`` with several KV groups.
        """
        if num_groups <= 1 or self.async_loads:
            return self
        if self.use_layerwise:
            raise ConfigError(
                "use_layerwise",
                True,
                f"false for a model with {num_groups} KV-cache groups (its loads must be asynchronous, load_async)",
            )
        log_once(
            logging.getLogger(__name__),
            logging.INFO,
            "model has %d KV-cache groups: pool loads run asynchronously (load_async=true), the only mode "
            "in which vLLM can recompute a request whose load failed",
            num_groups,
            key=("hybrid-async-loads", num_groups),
        )
        return dataclasses.replace(self, load_async=True)

    @property
    def is_consumer(self) -> bool:
        """Whether this instance is the decode side of a P/D pair."""
        return self.kv_role == "kv_consumer"

    @property
    def can_save(self) -> bool:
        """Whether this instance writes to the pool (producers, both, consumers with put)."""
        return not self.is_consumer or self.consumer_is_to_put

    @property
    def can_load(self) -> bool:
        """Whether this instance looks up and loads from the pool."""
        return not self.is_consumer or self.consumer_is_to_load

    @classmethod
    def from_extra(
        cls, extra: Mapping[str, object] | None, *, kv_role: str = "kv_both", kv_events: bool = False
    ) -> PoolConfig:
        """Validate ``kv_connector_extra_config``.

        Args:
            extra: The connector's extra config (None = all defaults).
            kv_role: vLLM's ``kv_role``.
            kv_events: Publish a ``BlockStored`` event per saved chunk (vLLM ``enable_kv_cache_events``).

        Returns:
            The validated configuration.

        Raises:
            ConfigError: A key has a bad value (the message names it), the backend is unknown, or
                shared layer buffers are asked of a backend other than memcache.
        """
        extra = dict(extra or {})
        if kv_role not in ROLES:
            raise ConfigError("kv_role", kv_role, format_allowed(ROLES))
        backend = extra.get("backend", "mooncake")
        if not isinstance(backend, str) or backend.strip().lower() not in BACKENDS:
            raise ConfigError("backend", backend, format_allowed(BACKENDS))
        port_key = "lookup_rpc_port" if "lookup_rpc_port" in extra else "mooncake_rpc_port"
        timeout = extra.get("lookup_timeout_s", 1.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 60:
            raise ConfigError("lookup_timeout_s", timeout, "a number of seconds in (0, 60]")
        cfg = cls(
            backend=backend.strip().lower(),
            kv_role=kv_role,
            lookup_rpc_port=_int(extra, port_key, 0),
            lookup_timeout_s=float(timeout),
            load_async=_bool(extra, "load_async", False),
            use_layerwise=_bool(extra, "use_layerwise", False),
            consumer_is_to_put=_bool(extra, "consumer_is_to_put", False),
            consumer_is_to_load=_bool(extra, "consumer_is_to_load", False),
            save_decode_cache=_bool(extra, "save_decode_cache", False),
            discard_partial_chunks=_bool(extra, "discard_partial_chunks", True),
            kv_events=kv_events,
            layerwise_prefetch_layers=_int(
                extra, "layerwise_prefetch_layers", 8 if backend.strip().lower() == "memcache" else 1, low=1
            ),
            layerwise_attention_gate=_bool(extra, "layerwise_attention_gate", False),
            h2d_stagger_us=_int(extra, "h2d_stagger_us", 0),
            layerwise_max_transfer_blocks=_int(extra, "layerwise_max_transfer_blocks", 0),
            layerwise_max_transfer_bytes=_int(extra, "layerwise_max_transfer_bytes", 0),
            layerwise_num_shared_buffers=_int(extra, "layerwise_num_shared_buffers", 0),
            layerwise_independent_layers=_independent_layers(extra.get("layerwise_independent_layers", [0])),
            prefill_tp_size=_int(extra, "prefill_tp_size", 0),
            decode_tp_size=_int(extra, "decode_tp_size", 0),
            prefill_pp_size=_int(extra, "prefill_pp_size", 1, low=1),
            prefill_pp_layer_partition=_partition(extra.get("prefill_pp_layer_partition")),
        )
        if not cfg.discard_partial_chunks and cfg.use_layerwise:
            raise ConfigError(
                "discard_partial_chunks", False, "true with use_layerwise (layer objects are whole chunks)"
            )
        if cfg.layerwise_num_shared_buffers and cfg.backend != "memcache":
            raise ConfigError(
                "layerwise_num_shared_buffers",
                cfg.layerwise_num_shared_buffers,
                "0 (shared layer buffers need memcache)",
            )
        return cfg

    def layerwise_options(self, tp_size: int) -> LayerwiseOptions:
        """The worker's layer-wise settings for a model with ``tp_size`` TP ranks."""
        return LayerwiseOptions(
            prefetch_layers=self.layerwise_prefetch_layers,
            attention_gate=self.layerwise_attention_gate,
            tp_size=tp_size,
            max_transfer_blocks=self.layerwise_max_transfer_blocks,
            max_transfer_bytes=self.layerwise_max_transfer_bytes,
            h2d_stagger_us=self.h2d_stagger_us,
            num_shared_buffers=self.layerwise_num_shared_buffers,
            independent_layers=self.layerwise_independent_layers,
        )

    @staticmethod
    def unknown_keys(extra: Mapping[str, object]) -> list[str]:
        """Keys of ``extra`` this package does not know (logged by the connector, not rejected)."""
        return sorted(k for k in extra if k not in _KNOWN_EXTRA)


def _independent_layers(value: object) -> tuple[int, ...] | str:
    if value == "all":
        return "all"
    if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ConfigError("layerwise_independent_layers", value, "a list of layer indices or 'all'")


def _partition(value: object) -> str | None:
    if value is None or (isinstance(value, str) and value.replace(",", "").replace(" ", "").isdigit()):
        return value.replace(" ", "") if isinstance(value, str) else None
    if isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)
    raise ConfigError("prefill_pp_layer_partition", value, "comma-separated layer counts, e.g. '31,30'")


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


@dataclass(frozen=True, kw_only=True)
class MooncakeStoreConfig:
    """Settings of the Mooncake Store client (``mooncake.json`` keys, spec §2.5.1)."""

    metadata_server: str = "P2PHANDSHAKE"
    master_server_address: str
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 1 << 30
    preferred_segment: bool = False
    prefer_alloc_in_same_node: bool = True

    @classmethod
    def load(
        cls,
        source: str | os.PathLike[str] | Mapping[str, object] | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> MooncakeStoreConfig:
        """Read the configuration from a mapping, a JSON file or ``MOONCAKE_CONFIG_PATH``.

        Args:
            source: A mapping of ``mooncake.json`` keys, a path, or None to use the environment.
            env: The environment (defaults to ``os.environ``); ``MOONCAKE_MASTER`` and
                ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` override the file.

        Returns:
            The validated configuration.

        Raises:
            ConfigError: No source, an unreadable file, a missing ``master_server_address``, a bad
                size (``global_segment_size``/``local_buffer_size``) or an unknown ``protocol``.
        """
        env = os.environ if env is None else env
        if source is None:
            path = env.get("MOONCAKE_CONFIG_PATH")
            if not path:
                raise ConfigError("MOONCAKE_CONFIG_PATH", path, "the path of a mooncake.json file")
            data = _read_json(path, "MOONCAKE_CONFIG_PATH")
        elif isinstance(source, Mapping):
            data = dict(source)
        else:
            data = _read_json(source, "mooncake config path")
        master = env.get("MOONCAKE_MASTER") or data.get("master_server_address")
        if not isinstance(master, str) or not master:
            raise ConfigError("master_server_address", master, "'host:port' of mooncake_master (or MOONCAKE_MASTER)")
        _host_port("master_server_address", master)
        segment_src = env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE") or data.get("global_segment_size", 1 << 30)
        protocol = _str(data, "protocol", "tcp").lower()
        if protocol not in MOONCAKE_PROTOCOLS:
            raise ConfigError("protocol", protocol, format_allowed(MOONCAKE_PROTOCOLS))
        for flag in ("preferred_segment", "prefer_alloc_in_same_node"):
            if flag in data and not isinstance(data[flag], bool):
                raise ConfigError(flag, data[flag], "a bool")
        return cls(
            metadata_server=_str(data, "metadata_server", "P2PHANDSHAKE"),
            master_server_address=master,
            protocol=protocol,
            device_name=_str(data, "device_name", ""),
            local_hostname=_str(data, "local_hostname", "127.0.0.1"),
            global_segment_size=parse_byte_size(segment_src, field="global_segment_size"),  # type: ignore[arg-type]
            local_buffer_size=parse_byte_size(data.get("local_buffer_size", 1 << 30), field="local_buffer_size"),  # type: ignore[arg-type]
            preferred_segment=bool(data.get("preferred_segment", False)),
            prefer_alloc_in_same_node=bool(data.get("prefer_alloc_in_same_node", True)),
        )


@dataclass(frozen=True, kw_only=True)
class YuanrongConfig:
    """Settings of the openYuanrong datasystem client (``YR_CONFIG_PATH`` JSON, spec §2.5.3)."""

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
        if source is None:
            path = env.get("YR_CONFIG_PATH")
            if not path:
                raise ConfigError("YR_CONFIG_PATH", path, "the path of the openYuanrong JSON config")
            data = _read_json(path, "YR_CONFIG_PATH")
        elif isinstance(source, Mapping):
            data = dict(source)
        else:
            data = _read_json(source, "yuanrong config path")
        host, port = _host_port("worker_addr", _str(data, "worker_addr", ""))
        return cls(
            host=host,
            port=port,
            connect_timeout_ms=_int(data, "connect_timeout_ms", 9000, low=1),
            request_timeout_ms=_int(data, "request_timeout_ms", 0),
        )
