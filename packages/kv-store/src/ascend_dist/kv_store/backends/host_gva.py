"""A host-memory store with memcache's native API: runs the layer-wise GVA path without Ascend.

Runs in: the process that creates it (tests, the demo, development on CPU). It implements the
semantics `MemcacheBackend` relies on: objects reserved with
``batch_alloc`` at real addresses of one host buffer, unreadable until ``batch_write_finish``
publishes them (``batch_add_lease`` answers -3101, ``batch_get_key_info`` size 0), read leases
that keep ``evict`` away, and ``batch_copy`` as ``memmove`` with bounds checks. Its "global memory"
belongs to this process, so it is a reference for one process, not a shared pool. Space of removed
objects is not reused (a bump allocator): size ``capacity_bytes`` for the run.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_store.backends.gva import G2L, L2G, UNMATCHED_STATE

__all__ = ["HostGvaStore", "KeyInfo"]

_ABSENT = -1  # alloc: no space or the key exists; lease/finish: no such object
_BAD_RANGE = -2  # copy outside the global buffer or with a bad direction


@dataclass(frozen=True)
class KeyInfo:
    """What ``batch_get_key_info`` returns per key (memcache's accessors are methods)."""

    _size: int
    _gvas: tuple[int, ...]

    def size(self) -> int:
        """Object size in bytes; 0 when absent or unpublished."""
        return self._size

    def gva_list(self) -> list[int]:
        """Global addresses of the object's replicas (one here)."""
        return list(self._gvas)


@dataclass
class _Object:
    gva: int
    size: int
    published: bool = False
    lease_until: float = 0.0


class HostGvaStore:
    """One host buffer as global memory; thread-safe."""

    def __init__(self, capacity_bytes: int = 64 << 20, *, clock: Callable[[], float] = time.monotonic) -> None:
        """Allocate the global buffer.

        Raises:
            ConfigError: ``capacity_bytes`` is not a positive int.
        """
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError("capacity_bytes", capacity_bytes, "a positive number of bytes")
        self._buffer = (ctypes.c_char * capacity_bytes)()
        self._base = ctypes.addressof(self._buffer)
        self._capacity = capacity_bytes
        self._next = 0
        self._objects: dict[str, _Object] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.registered: list[tuple[int, int]] = []
        self.copies = 0

    # ---- setup ----

    def init(self, local_rank: int, init_bm: bool = True) -> int:
        """Nothing to start; 0."""
        del local_rank, init_bm
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        """Remember the region (copies may touch any local address, as with pinned host memory)."""
        self.registered.append((ptr, size))
        return 0

    def close(self) -> None:
        """A client closing leaves the objects in global memory (other clients of the store still read them)."""

    # ---- metadata ----

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 per published object."""
        with self._lock:
            return [1 if (o := self._objects.get(k)) is not None and o.published else 0 for k in keys]

    def batch_get_key_info(self, keys: list[str]) -> list[KeyInfo]:
        """Size and GVA of each published object."""
        with self._lock:
            out = []
            for key in keys:
                obj = self._objects.get(key)
                out.append(KeyInfo(obj.size, (obj.gva,)) if obj is not None and obj.published else KeyInfo(0, ()))
            return out

    def batch_alloc(self, keys: list[str], sizes: list[int]) -> list[int]:
        """Reserve unpublished objects; -1 for an existing key or when the buffer is full."""
        with self._lock:
            out = []
            for key, size in zip(keys, sizes, strict=True):
                if key in self._objects or size <= 0 or self._next + size > self._capacity:
                    out.append(_ABSENT)
                    continue
                obj = _Object(self._base + self._next, size)
                self._next += size
                self._objects[key] = obj
                out.append(obj.gva)
            return out

    def batch_write_finish(self, keys: list[str], results: list[int]) -> list[int]:
        """Publish (result 0) or drop (non-zero) reserved objects; -1 for a key not reserved."""
        with self._lock:
            out = []
            for key, result in zip(keys, results, strict=True):
                obj = self._objects.get(key)
                if obj is None or obj.published:
                    out.append(_ABSENT)
                elif result == 0:
                    obj.published = True
                    out.append(0)
                else:
                    del self._objects[key]
                    out.append(0)
            return out

    def batch_add_lease(self, keys: list[str], ttl_ms: int) -> list[int]:
        """Lease published objects; -3101 for an unpublished one, -1 for a missing one."""
        with self._lock:
            until = self._clock() + ttl_ms / 1000
            out = []
            for key in keys:
                obj = self._objects.get(key)
                if obj is None:
                    out.append(_ABSENT)
                elif not obj.published:
                    out.append(UNMATCHED_STATE)
                else:
                    obj.lease_until = max(obj.lease_until, until)
                    out.append(0)
            return out

    def batch_remove_lease(self, keys: list[str]) -> int:
        """Release leases."""
        with self._lock:
            for key in keys:
                if (obj := self._objects.get(key)) is not None:
                    obj.lease_until = 0.0
            return 0

    def evict(self, keys: Sequence[str]) -> list[str]:
        """Remove published, unleased objects (what the store does under memory pressure); the removed keys."""
        with self._lock:
            now = self._clock()
            gone = [k for k in keys if (o := self._objects.get(k)) is not None and o.published and o.lease_until <= now]
            for key in gone:
                del self._objects[key]
            return gone

    # ---- data ----

    def batch_copy(self, gvas: list[int], addrs: list[int], sizes: list[int], direction: int) -> int:
        """Copy each piece between global and local memory (memmove); -2 if a piece leaves the buffer."""
        if direction not in (L2G, G2L):
            return _BAD_RANGE
        end = self._base + self._capacity
        if any(g < self._base or g + s > end or s < 0 for g, s in zip(gvas, sizes, strict=True)):
            return _BAD_RANGE
        for gva, addr, size in zip(gvas, addrs, sizes, strict=True):
            src, dst = (addr, gva) if direction == L2G else (gva, addr)
            ctypes.memmove(dst, src, size)
        self.copies += 1
        return 0

    def batch_put_from_layers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], direction: int
    ) -> list[int]:
        """Whole objects from pieces (the non-layer-wise path): alloc, copy, publish."""
        if direction != L2G:
            return [_BAD_RANGE] * len(keys)
        codes = []
        for key, gva, a, s in zip(keys, self.batch_alloc(keys, [sum(s) for s in sizes]), addrs, sizes, strict=True):
            if gva <= 0:
                codes.append(_ABSENT)
                continue
            rc = self.batch_copy(_packed(gva, s), a, s, L2G)
            self.batch_write_finish([key], [rc])
            codes.append(rc)
        return codes

    def batch_get_into_layers(
        self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]], direction: int
    ) -> list[int]:
        """Scatter whole objects into pieces; -3101 per missing object or size mismatch."""
        if direction != G2L:
            return [_BAD_RANGE] * len(keys)
        codes = []
        for info, a, s in zip(self.batch_get_key_info(keys), addrs, sizes, strict=True):
            if info.size() == 0 or info.size() != sum(s):
                codes.append(UNMATCHED_STATE)
                continue
            codes.append(self.batch_copy(_packed(info.gva_list()[0], s), a, s, G2L))
        return codes


def _packed(gva: int, sizes: Sequence[int]) -> list[int]:
    """Global addresses of pieces stored back to back from ``gva``."""
    return [gva + before for before in itertools.accumulate(sizes, initial=0)][: len(sizes)]
