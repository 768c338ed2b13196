"""What one pool store call moved, in the connector's transfer stats (channel ``pool``).

Runs in: worker processes (the threads that call the store). `load_batches` and the GVA layer copies
call `record_call` once per store call, so the stats see exactly what went to and from the store:

* one transfer per call that moved anything: its wall time, the bytes and the ``(addr, size)``
  pieces (descriptors) of the keys the store answered 0 for; a key it failed moves no bytes;
* one failure per key the store did not get or put, by kind (`failure_kind` of its code; a call that
  raised `StoreError` fails every key it carried, as ``peer_unreachable``: the store could not be
  reached, per the `PoolBackend` contract).

Direction: ``load`` (a get: pool -> this instance's KV cache), ``save`` (a put: KV cache -> pool).
"""

from __future__ import annotations

from collections.abc import Sequence

from ascend_dist.common.errors import StoreError
from ascend_dist.common.transfer_stats import Direction, FailureKind, TransferStats

__all__ = ["failure_kind", "record_call"]

# Mooncake Store codes (`backends.base.MOONCAKE_CODES`) by what an operator should suspect.
_KINDS: dict[int, FailureKind] = {
    -704: FailureKind.LEASE_EXPIRED,  # OBJECT_NOT_FOUND: evicted (or never stored) since the lookup
    -707: FailureKind.LEASE_EXPIRED,  # LEASE_EXPIRED
    -101: FailureKind.PEER_UNREACHABLE,  # SEGMENT_NOT_FOUND: the instance holding the replica is gone
    -800: FailureKind.PEER_UNREACHABLE,  # TRANSFER_FAIL: the transport could not reach the replica
    -900: FailureKind.PEER_UNREACHABLE,  # RPC_FAIL: the master did not answer
    -10: FailureKind.REFUSED,  # BUFFER_OVERFLOW
    -200: FailureKind.REFUSED,  # NO_AVAILABLE_HANDLE: the pool is full
    -600: FailureKind.REFUSED,  # INVALID_PARAMS
    -706: FailureKind.REFUSED,  # OBJECT_HAS_LEASE: a put of an object being read
}


def failure_kind(code: int) -> FailureKind:
    """The failure kind of a store's non-zero per-key code (unknown codes, other backends': ``other``)."""
    return _KINDS.get(int(code), FailureKind.OTHER)


def record_call(
    stats: TransferStats | None,
    direction: Direction,
    seconds: float,
    sizes: Sequence[Sequence[int]],
    codes: Sequence[int] | StoreError,
) -> None:
    """Record one store call over keys with piece sizes ``sizes``: its per-key ``codes``, or the error it raised."""
    if stats is None:
        return
    if isinstance(codes, StoreError):
        for _ in sizes:
            stats.record_failure(direction, FailureKind.PEER_UNREACHABLE)
        return
    nbytes = pieces = 0
    for piece_sizes, code in zip(sizes, codes, strict=True):
        if code == 0:
            nbytes += sum(piece_sizes)
            pieces += len(piece_sizes)
        else:
            stats.record_failure(direction, failure_kind(code))
    if pieces:
        stats.record_transfer(direction, seconds, nbytes, pieces)
