"""The pool backend Protocol and the result-code conventions every backend follows.

Runs in: worker processes. Contract:

* ``exists(keys)`` -> one int per key: 1 present, 0 absent; a store that cannot be asked raises
  `StoreError` (callers treat it as "absent", i.e. a cache miss).
* ``put(keys, addrs, sizes)`` -> one code per key, 0 = stored (or already present). Each key's
  value is the concatenation of its ``(addr, size)`` pieces.
* ``get(keys, addrs, sizes)`` -> one code per key, 0 = loaded; non-zero = that key failed (Mooncake
  codes, e.g. -704 object not found). Positive byte counts from the native client are normalised to
  0 here (upstream forgot to for some paths). A store that cannot be reached raises `StoreError`;
  the caller then reports every block of the call as a load error.
* ``max_pieces_per_call`` (optional class attribute, read with `piece_cap`): the most ``(addr, size)``
  pieces one ``get`` or ``put`` may carry; callers split larger batches (`load_batches`). Absent or
  None: no limit.
* GVA operations (``batch_get_key_info``, ``batch_alloc``, leases, ``batch_write_finish``) are
  optional: backends without them raise `UnsupportedOperation` naming the backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol, runtime_checkable

from ascend_dist.common.errors import StoreError

__all__ = [
    "MOONCAKE_CODES",
    "PoolBackend",
    "TransferBatch",
    "UnsupportedOperation",
    "normalize_get_codes",
    "piece_cap",
]

# Mooncake Store error codes seen by the pool.
MOONCAKE_CODES: Final[dict[int, str]] = {
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
}
OBJECT_NOT_FOUND: Final = -704
OBJECT_ALREADY_EXISTS: Final = -705
INVALID_PARAMS: Final = -600


class UnsupportedOperation(StoreError, NotImplementedError):
    """The backend has no such operation (e.g. GVA calls on Mooncake); use another code path."""


def normalize_get_codes(raw: Sequence[int]) -> list[int]:
    """Map native get results to 0 (ok) / negative (failed): positive byte counts become 0."""
    return [0 if int(code) >= 0 else int(code) for code in raw]


def piece_cap(backend: object) -> int | None:
    """The backend's ``max_pieces_per_call`` (None: no limit; backends without the attribute have none)."""
    cap = getattr(backend, "max_pieces_per_call", None)
    return cap if isinstance(cap, int) and cap > 0 else None


def describe_code(code: int) -> str:
    """Human name of a Mooncake code, e.g. ``-704 (OBJECT_NOT_FOUND)``."""
    return f"{code} ({MOONCAKE_CODES.get(code, 'UNKNOWN')})"


@dataclass(frozen=True)
class TransferBatch:
    """Keys with their ``(addr, size)`` piece lists, as one put or get call."""

    keys: tuple[str, ...]
    addrs: tuple[Sequence[int], ...]
    sizes: tuple[Sequence[int], ...]

    def __len__(self) -> int:
        return len(self.keys)

    def rotated(self, by: int) -> TransferBatch:
        """The batch rotated left by ``by`` (so TP ranks start on different keys)."""
        if not self.keys:
            return self
        k = by % len(self.keys)
        return TransferBatch(
            self.keys[k:] + self.keys[:k], self.addrs[k:] + self.addrs[:k], self.sizes[k:] + self.sizes[:k]
        )


@runtime_checkable
class PoolBackend(Protocol):
    """One client of the external store, owned by one worker (or the scheduler)."""

    name: str

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Make memory regions usable as put sources and get destinations.

        Raises:
            StoreError: The store refused a region.
        """
        ...

    def exists(self, keys: Sequence[str]) -> list[int]:
        """1 present / 0 absent per key.

        Raises:
            StoreError: The store cannot be asked.
        """
        ...

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Store each key from its pieces; 0 per stored key, negative per failure.

        Raises:
            StoreError: The store cannot be reached.
        """
        ...

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Scatter each object into its pieces; 0 per loaded key, non-zero per failure.

        Raises:
            StoreError: The store cannot be reached.
        """
        ...

    def close(self) -> None:
        """Release registrations and the connection. Idempotent."""
        ...
