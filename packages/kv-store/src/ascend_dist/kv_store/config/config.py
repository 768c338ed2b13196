"""Pool configuration: ``kv_connector_extra_config`` keys and the backend files/environment.

Runs in: scheduler and worker processes, at construction time. Pure apart from reading the named
configuration files. Every bad value raises `ConfigError` naming the key and the allowed values,
before any resource is taken.

Sources, in order of precedence:

* ``kv_connector_extra_config`` (`PoolConfig.from_extra`);
* Mooncake (in `ascend_dist.kv_store.config.store_config`, re-exported here): the JSON file at
  ``MOONCAKE_CONFIG_PATH`` (or an explicit path / mapping), overridden by
  ``MOONCAKE_MASTER`` and ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` (`MooncakeStoreConfig.load`);
* openYuanrong: the JSON file at ``YR_CONFIG_PATH`` (`YuanrongConfig.load`).

Sizes accept ``ascend_dist.common.units`` byte strings (``"1GB"``, ``"512 MiB"``, ``1024``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from ascend_dist.common.errors import ConfigError, format_allowed
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.config.layerwise_options import LayerwiseOptions
from ascend_dist.kv_store.config.store_config import (
    MOONCAKE_PROTOCOLS,
    MooncakeStoreConfig,
    YuanrongConfig,
    int_setting,
)

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
            lookup_rpc_port=int_setting(extra, port_key, 0),
            lookup_timeout_s=float(timeout),
            load_async=_bool(extra, "load_async", False),
            use_layerwise=_bool(extra, "use_layerwise", False),
            consumer_is_to_put=_bool(extra, "consumer_is_to_put", False),
            consumer_is_to_load=_bool(extra, "consumer_is_to_load", False),
            save_decode_cache=_bool(extra, "save_decode_cache", False),
            discard_partial_chunks=_bool(extra, "discard_partial_chunks", True),
            kv_events=kv_events,
            layerwise_prefetch_layers=int_setting(
                extra, "layerwise_prefetch_layers", 8 if backend.strip().lower() == "memcache" else 1, low=1
            ),
            layerwise_attention_gate=_bool(extra, "layerwise_attention_gate", False),
            h2d_stagger_us=int_setting(extra, "h2d_stagger_us", 0),
            layerwise_max_transfer_blocks=int_setting(extra, "layerwise_max_transfer_blocks", 0),
            layerwise_max_transfer_bytes=int_setting(extra, "layerwise_max_transfer_bytes", 0),
            layerwise_num_shared_buffers=int_setting(extra, "layerwise_num_shared_buffers", 0),
            layerwise_independent_layers=_independent_layers(extra.get("layerwise_independent_layers", [0])),
            prefill_tp_size=int_setting(extra, "prefill_tp_size", 0),
            decode_tp_size=int_setting(extra, "decode_tp_size", 0),
            prefill_pp_size=int_setting(extra, "prefill_pp_size", 1, low=1),
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
