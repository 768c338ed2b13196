"""memcache (``memcache_hybrid.DistributedObjectStore``) backend: needs the Ascend driver.

Runs in: worker processes. On a machine without the Ascend driver, ``init(rank, init_bm=True)``
returns -1 ("Failed to init smem bm") and ``init_bm=False`` connects but every put fails; so the
backend raises `MemcacheUnavailable` at construction, with the reason, instead of running broken.
With a working native store (on Ascend, or `HostGvaStore` on CPU) it maps the Protocols onto the
same-named calls: `PoolBackend` onto ``batch_put_from_layers``/``batch_get_into_layers``
(directions 0 L2G / 1 G2L), `GvaBackend` onto ``batch_get_key_info``, ``batch_alloc``,
``batch_add_lease``, ``batch_remove_lease``, ``batch_write_finish`` and ``batch_copy``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ascend_dist.common.errors import StoreError
from ascend_dist.kv_store.backends.gva import G2L, L2G

__all__ = ["MemcacheBackend", "MemcacheStore", "MemcacheUnavailable"]

logger = logging.getLogger(__name__)


class MemcacheUnavailable(StoreError):
    """memcache cannot run here (no Ascend driver, or the package is missing): pick another backend."""


class MemcacheStore(Protocol):
    """The subset of ``memcache_hybrid.DistributedObjectStore`` this backend calls."""

    def init(self, local_rank: int, init_bm: bool = True) -> int:
        """Native call."""
        ...

    def register_buffer(self, ptr: int, size: int) -> int:
        """Native call."""
        ...

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """Native call."""
        ...

    def batch_put_from_layers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], direction: int
    ) -> list[int]:
        """Native batch call."""
        ...

    def batch_get_into_layers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], direction: int
    ) -> list[int]:
        """Native batch call."""
        ...

    def batch_get_key_info(self, keys: list[str]) -> list[Any]:
        """Native call: objects with ``size()`` and ``gva_list()``."""
        ...

    def batch_alloc(self, keys: list[str], sizes: list[int]) -> list[int]:
        """Native call."""
        ...

    def batch_add_lease(self, keys: list[str], ttl_ms: int) -> list[int]:
        """Native call."""
        ...

    def batch_remove_lease(self, keys: list[str]) -> int:
        """Native call."""
        ...

    def batch_copy(self, gvas: list[int], addrs: list[int], sizes: list[int], direction: int) -> int:
        """Native call."""
        ...

    def close(self) -> Any:
        """Native call."""
        ...


def _default_factory() -> MemcacheStore:
    try:
        from memcache_hybrid import DistributedObjectStore  # type: ignore[import-not-found]
    except ImportError as exc:
        raise MemcacheUnavailable(f"memcache_hybrid is not installed ({exc}); install the 'memcache' extra") from exc
    return DistributedObjectStore()


class MemcacheBackend:
    """A `PoolBackend` over memcache."""

    name = "memcache"

    def __init__(self, *, local_rank: int = 0, store_factory: Callable[[], MemcacheStore] = _default_factory) -> None:
        """Initialise the native store.

        Raises:
            MemcacheUnavailable: The package is missing or ``init`` failed (no Ascend driver).
        """
        self._store = store_factory()
        rc = self._store.init(local_rank, True)
        if rc != 0:
            raise MemcacheUnavailable(
                f"memcache init(local_rank={local_rank}, init_bm=True) returned {rc}: memcache needs the Ascend "
                "driver (/usr/local/Ascend/driver); use backend 'mooncake' or 'yuanrong' on this machine"
            )

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Register each region.

        Raises:
            StoreError: The store refused a region.
        """
        for ptr, size in zip(ptrs, lengths, strict=True):
            rc = self._store.register_buffer(ptr, size)
            if rc != 0:
                raise StoreError(f"memcache register_buffer({ptr:#x}, {size}) returned {rc}")

    def exists(self, keys: Sequence[str]) -> list[int]:
        """``batch_is_exist``.

        Raises:
            StoreError: A result other than 0/1.
        """
        codes = [int(c) for c in self._store.batch_is_exist(list(keys))] if keys else []
        if any(c not in (0, 1) for c in codes):
            raise StoreError(f"memcache batch_is_exist returned {sorted(set(codes))}")
        return codes

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """``batch_put_from_layers`` device -> global."""
        if not keys:
            return []
        codes = self._store.batch_put_from_layers(list(keys), [list(a) for a in addrs], [list(s) for s in sizes], L2G)
        return [int(c) for c in codes]

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """``batch_get_into_layers`` global -> device."""
        if not keys:
            return []
        codes = self._store.batch_get_into_layers(list(keys), [list(a) for a in addrs], [list(s) for s in sizes], G2L)
        return [int(c) for c in codes]

    # ---- GVA calls (the layer-wise GVA path) ----

    def key_info(self, keys: Sequence[str]) -> list[tuple[int, int]]:
        """``batch_get_key_info``: ``(size, first GVA)`` per key, ``(0, 0)`` when absent.

        Raises:
            StoreError: The store answered for another number of keys.
        """
        if not keys:
            return []
        infos = self._store.batch_get_key_info(list(keys))
        if len(infos) != len(keys):
            raise StoreError(f"memcache batch_get_key_info answered {len(infos)} infos for {len(keys)} keys")
        out: list[tuple[int, int]] = []
        for info in infos:
            size = int(info.size())
            gvas = list(info.gva_list()) if size > 0 else []
            out.append((size, int(gvas[0])) if gvas else (0, 0))
        return out

    def alloc(self, keys: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """``batch_alloc``: a GVA per key, <= 0 per failure (an existing key fails)."""
        return [int(g) for g in self._store.batch_alloc(list(keys), list(sizes))] if keys else []

    def add_lease(self, keys: Sequence[str], ttl_ms: int) -> list[int]:
        """``batch_add_lease``.

        Raises:
            StoreError: The store answered for another number of keys.
        """
        if not keys:
            return []
        codes = [int(c) for c in self._store.batch_add_lease(list(keys), ttl_ms)]
        if len(codes) != len(keys):
            raise StoreError(f"memcache batch_add_lease answered {len(codes)} codes for {len(keys)} keys")
        return codes

    def remove_lease(self, keys: Sequence[str]) -> int:
        """``batch_remove_lease``."""
        return int(self._store.batch_remove_lease(list(keys))) if keys else 0

    def write_finish(self, keys: Sequence[str], results: Sequence[int]) -> list[int]:
        """``batch_write_finish``; releases without it publish in ``batch_copy`` (all zeros).

        Raises:
            StoreError: The store answered for another number of keys.
        """
        finish = getattr(self._store, "batch_write_finish", None)
        if not keys or finish is None:
            return [0] * len(keys)
        codes = [int(c) for c in finish(list(keys), list(results))]
        if len(codes) != len(keys):
            raise StoreError(f"memcache batch_write_finish answered {len(codes)} codes for {len(keys)} keys")
        return codes

    def copy(self, gvas: Sequence[int], addrs: Sequence[int], sizes: Sequence[int], direction: int) -> int:
        """``batch_copy`` between global and local memory; 0 or the native error code."""
        if not gvas:
            return 0
        return int(self._store.batch_copy(list(gvas), list(addrs), list(sizes), direction))

    def close(self) -> None:
        """Close the native store."""
        self._store.close()
