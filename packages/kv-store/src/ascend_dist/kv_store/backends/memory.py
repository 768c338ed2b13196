"""In-memory reference backend: a dict of key -> bytes with Mooncake's result codes.

Runs in: tests and the ``pool`` demo, in one process. Reads and writes real memory with ctypes, so
a worker over CPU tensors round-trips byte-exact. Not shared between processes.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

from ascend_dist.common.errors import StoreError
from ascend_dist.kv_store.backends.base import INVALID_PARAMS, OBJECT_NOT_FOUND

__all__ = ["InMemoryBackend"]

_TRANSFER_FAIL = -800


class InMemoryBackend:
    """A `PoolBackend` keeping objects in this process; ``available=False`` simulates an outage."""

    name = "memory"
    max_pieces_per_call: int | None = None  # no transport: any batch size

    def __init__(self) -> None:
        """Create an empty store."""
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.available = True
        self.registered: list[tuple[int, int]] = []
        self.put_calls = 0
        self.get_calls = 0

    def _check(self) -> None:
        if not self.available:
            raise StoreError("in-memory store is marked unavailable")

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Remember the regions (nothing to pin in-process)."""
        self.registered.extend(zip(ptrs, lengths, strict=True))

    def exists(self, keys: Sequence[str]) -> list[int]:
        """1/0 per key."""
        self._check()
        with self._lock:
            return [1 if k in self._objects else 0 for k in keys]

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Copy each key's pieces into one object; an existing key is kept (0)."""
        self._check()
        self.put_calls += 1
        codes: list[int] = []
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes, strict=True):
            data = b"".join(ctypes.string_at(a, s) for a, s in zip(key_addrs, key_sizes, strict=True))
            with self._lock:
                self._objects.setdefault(key, data)
            codes.append(0)
        return codes

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Scatter each object into its pieces: -704 missing, -600 too small, -800 too large."""
        self._check()
        self.get_calls += 1
        codes: list[int] = []
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes, strict=True):
            with self._lock:
                data = self._objects.get(key)
            total = sum(key_sizes)
            if data is None:
                codes.append(OBJECT_NOT_FOUND)
                continue
            if total != len(data):
                codes.append(INVALID_PARAMS if total < len(data) else _TRANSFER_FAIL)
                continue
            pos = 0
            for addr, size in zip(key_addrs, key_sizes, strict=True):
                ctypes.memmove(addr, data[pos : pos + size], size)
                pos += size
            codes.append(0)
        return codes

    def remove(self, keys: Sequence[str]) -> None:
        """Drop objects (simulates eviction)."""
        with self._lock:
            for k in keys:
                self._objects.pop(k, None)

    def stored_keys(self) -> list[str]:
        """Every stored key."""
        with self._lock:
            return list(self._objects)

    def close(self) -> None:
        """Nothing to release."""
