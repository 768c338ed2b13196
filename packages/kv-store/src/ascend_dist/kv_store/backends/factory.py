"""Backend selection by name (``backend`` in ``kv_connector_extra_config``).

Runs in: worker and scheduler processes. Imports each native client only when selected.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ascend_dist.common.errors import ConfigError, StoreError, format_allowed
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.config.config import BACKENDS, MooncakeStoreConfig, YuanrongConfig
from ascend_dist.kv_store.config.store_config import runtime_memory_kind

__all__ = ["UnavailableBackend", "create_backend", "create_backend_or_unavailable"]

logger = logging.getLogger(__name__)


def create_backend(
    name: str,
    *,
    contribute_memory: bool = True,
    local_rank: int = 0,
    global_rank: int = 0,
    backend_config: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    memory_kind: str | None = None,
) -> PoolBackend:
    """Create the named backend.

    Args:
        name: ``mooncake``, ``yuanrong`` or ``memcache``.
        contribute_memory: Mooncake: whether this client contributes a segment.
        local_rank: memcache: the local device rank.
        global_rank: Mooncake: the worker's rank (its SSD offload directory).
        backend_config: The backend's config as a mapping (instead of its file/env variable).
        env: Environment to read config paths and overrides from.
        memory_kind: Where the KV caches live (``npu``, ``cuda``, ``cpu``); None asks the device
            runtime when a backend needs it (Mooncake's default protocol, openYuanrong's check).

    Returns:
        The backend. A Mooncake store that is unreachable yields a disconnected backend (misses).

    Raises:
        ConfigError: Unknown backend or bad backend configuration (names the key), or
            openYuanrong with KV caches in device memory.
        StoreError: openYuanrong unreachable, or memcache unusable on this machine.
    """
    key = name.strip().lower()
    if key == "mooncake":
        from ascend_dist.kv_store.backends.mooncake import MooncakeBackend

        cfg = MooncakeStoreConfig.load(backend_config, env=env, memory_kind=memory_kind)
        return MooncakeBackend(cfg, contribute_memory=contribute_memory, global_rank=global_rank)
    if key == "yuanrong":
        from ascend_dist.kv_store.backends.yuanrong import YuanrongBackend

        cfg_yr = YuanrongConfig.load(backend_config, env=env)
        return YuanrongBackend(cfg_yr, memory_kind=runtime_memory_kind(env) if memory_kind is None else memory_kind)
    if key == "memcache":
        from ascend_dist.kv_store.backends.memcache import MemcacheBackend

        return MemcacheBackend(local_rank=local_rank)
    raise ConfigError("backend", name, format_allowed(BACKENDS))


class UnavailableBackend:
    """Stands in for a store that could not be reached at start: every call is a `StoreError` (a miss)."""

    def __init__(self, name: str, reason: str) -> None:
        """Remember why the store is unavailable."""
        self.name = name
        self._reason = reason

    def _fail(self) -> StoreError:
        return StoreError(f"{self.name} store unavailable since start-up: {self._reason}")

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Nothing to register with."""

    def exists(self, keys: Sequence[str]) -> list[int]:
        """Always a `StoreError`."""
        raise self._fail()

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Always a `StoreError`."""
        raise self._fail()

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Always a `StoreError`."""
        raise self._fail()

    def close(self) -> None:
        """Nothing to release."""


def create_backend_or_unavailable(name: str, **kwargs: Any) -> PoolBackend:
    """`create_backend`, but a store unreachable at start yields `UnavailableBackend` and one warning.

    Configuration errors still raise `ConfigError`: a bad config is a bug to fix, an absent store
    is an operational state the pool runs through with zero hits.
    """
    try:
        return create_backend(name, **kwargs)
    except StoreError as exc:
        logger.warning("KV pool backend %s unavailable (%s); running with zero pool hits", name, exc)
        return UnavailableBackend(name, str(exc))
