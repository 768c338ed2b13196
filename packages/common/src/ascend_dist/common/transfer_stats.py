"""Transfer statistics a connector records between two of vLLM's stats polls (no vLLM import).

Runs in: any process of a connector (the scheduler for pool lookups, the workers for transfers).
A `TransferStats` recorder is written by transfer threads and read by vLLM's step thread: every
call takes one lock, and `TransferStats.take` hands out what was recorded since the last call and
starts afresh (snapshot-and-reset), so each observation reaches vLLM exactly once.

What is recorded, per channel (``p2p``: kv-mooncake's P/D transfers, ``pool``: the KV pool,
``offload``: host offload) and direction (``load``: into this instance's device cache, ``save``:
out of it):

- each transfer: its duration, bytes and number of descriptors (one engine batch call, one pool
  get/put batch, one offload copy job);
- each failure, by kind (`FailureKind`: lease expired, peer unreachable, timeout, refused, other);
- pool lookups: prompt tokens found in the pool (hit) and not found (miss).

The snapshot is `StatsData`, a plain msgspec struct; `to_builtins` / `from_builtins` turn it into
JSON-safe lists and back (it crosses vLLM's process boundaries as that dict), `merge` adds two
snapshots and `summarize` reduces one to the numbers of vLLM's periodic "KV Transfer metrics" line.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import msgspec

from ascend_dist.common.errors import (
    DeadlineExceeded,
    IncompatiblePeer,
    LeaseExpired,
    PeerUnreachable,
    ProtocolError,
    TransferRefused,
)

__all__ = [
    "CHANNELS",
    "DIRECTIONS",
    "Channel",
    "Direction",
    "FailureKind",
    "StatsData",
    "TransferStats",
    "classify_failure",
    "from_builtins",
    "merge",
    "summarize",
    "to_builtins",
]

Channel = Literal["p2p", "pool", "offload"]
Direction = Literal["load", "save"]
CHANNELS: tuple[Channel, ...] = ("p2p", "pool", "offload")
DIRECTIONS: tuple[Direction, ...] = ("load", "save")

# The marker key of the builtins form: vLLM's multi-connector sees children's payloads as plain dicts.
SCHEMA_KEY = "ascend_dist_stats"
SCHEMA_VERSION = 1


class FailureKind(enum.StrEnum):
    """Why a transfer failed, as the failure counters label it."""

    LEASE_EXPIRED = "lease_expired"  # the peer no longer holds the blocks (its lease ran out, or they were freed)
    PEER_UNREACHABLE = "peer_unreachable"  # no answer from the peer's address at all
    TIMEOUT = "timeout"  # a deadline ran out (transfer, side channel or the request's own)
    REFUSED = "refused"  # the peer answered no: handshake mismatch, refused request, wrong rank
    OTHER = "other"


def classify_failure(exc: BaseException) -> FailureKind:
    """The kind of a transfer failure, from the typed error raised for it (most specific first)."""
    if isinstance(exc, LeaseExpired):
        return FailureKind.LEASE_EXPIRED
    if isinstance(exc, PeerUnreachable | ConnectionError):
        return FailureKind.PEER_UNREACHABLE
    if isinstance(exc, DeadlineExceeded | TimeoutError):
        return FailureKind.TIMEOUT
    if isinstance(exc, TransferRefused | IncompatiblePeer | ProtocolError):
        return FailureKind.REFUSED
    return FailureKind.OTHER


class Transfer(msgspec.Struct, frozen=True, array_like=True):
    """One transfer: channel, direction, seconds, bytes, descriptors."""

    channel: Channel
    direction: Direction
    duration_s: float
    nbytes: int
    descriptors: int


class Failure(msgspec.Struct, frozen=True, array_like=True):
    """Failures of one (channel, direction, kind) since the last snapshot."""

    channel: Channel
    direction: Direction
    kind: FailureKind
    count: int


class StatsData(msgspec.Struct, kw_only=True):
    """One snapshot: what a recorder saw since the previous one (or several snapshots merged)."""

    transfers: list[Transfer] = []
    failures: list[Failure] = []
    pool_hit_tokens: int = 0
    pool_miss_tokens: int = 0

    def is_empty(self) -> bool:
        """Nothing was recorded."""
        return not (self.transfers or self.failures or self.pool_hit_tokens or self.pool_miss_tokens)


def to_builtins(data: StatsData) -> dict[str, Any]:
    """The JSON-safe dict vLLM carries between processes (`KVConnectorStats.data`)."""
    out: dict[str, Any] = msgspec.to_builtins(data)
    out[SCHEMA_KEY] = SCHEMA_VERSION
    return out


def is_stats_payload(value: object) -> bool:
    """Whether ``value`` is the builtins form of a `StatsData` (the multi-connector tells children apart)."""
    return isinstance(value, dict) and value.get(SCHEMA_KEY) == SCHEMA_VERSION


def from_builtins(value: object) -> StatsData:
    """Read a snapshot back from its builtins form.

    Raises:
        ProtocolError: ``value`` is not a snapshot of this schema version (the message names the field).
    """
    if not isinstance(value, dict) or value.get(SCHEMA_KEY) != SCHEMA_VERSION:
        raise ProtocolError(f"connector stats: {SCHEMA_KEY} is not {SCHEMA_VERSION}")
    fields = {k: v for k, v in value.items() if k != SCHEMA_KEY}
    try:
        data = msgspec.convert(fields, StatsData, strict=False)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"connector stats: {exc}") from None
    bad = [t for t in data.transfers if t.duration_s < 0 or t.nbytes < 0 or t.descriptors < 0]
    if bad or any(f.count < 0 for f in data.failures) or min(data.pool_hit_tokens, data.pool_miss_tokens) < 0:
        raise ProtocolError("connector stats: a negative duration, size or count")
    return data


def merge(into: StatsData, other: StatsData) -> StatsData:
    """Add ``other`` to ``into`` (in place) and return ``into``."""
    into.transfers.extend(other.transfers)
    into.failures.extend(other.failures)
    into.pool_hit_tokens += other.pool_hit_tokens
    into.pool_miss_tokens += other.pool_miss_tokens
    return into


def summarize(data: StatsData) -> dict[str, int | float]:
    """The numbers of vLLM's "KV Transfer metrics" log line: per channel and direction that moved anything.

    Keys read like vLLM's Mooncake ones, prefixed with the channel and direction
    (``"p2p load: Num successful transfers"``), then failures per kind and the pool's tokens.
    """
    out: dict[str, int | float] = {}
    for channel in CHANNELS:
        for direction in DIRECTIONS:
            rows = [t for t in data.transfers if t.channel == channel and t.direction == direction]
            if not rows:
                continue
            total_s = sum(t.duration_s for t in rows)
            total_mb = sum(t.nbytes for t in rows) / 2**20
            name = f"{channel} {direction}"
            out[f"{name}: Num successful transfers"] = len(rows)
            out[f"{name}: Avg xfer time (ms)"] = round(total_s / len(rows) * 1e3, 3)
            out[f"{name}: MB transferred"] = round(total_mb, 3)
            out[f"{name}: Throughput (MB/s)"] = round(total_mb / total_s, 3) if total_s > 0 else 0.0
            out[f"{name}: Avg number of descriptors"] = round(sum(t.descriptors for t in rows) / len(rows), 1)
    failures: dict[str, int] = {}
    for f in data.failures:
        key = f"{f.channel} {f.direction}: Num failed transfers ({f.kind.value})"
        failures[key] = failures.get(key, 0) + f.count
    out.update(sorted(failures.items()))
    if data.pool_hit_tokens or data.pool_miss_tokens:
        out["pool: Hit tokens"] = data.pool_hit_tokens
        out["pool: Miss tokens"] = data.pool_miss_tokens
    return out


class TransferStats:
    """The thread-safe recorder one connector instance owns (one per process and connector).

    ``channel`` is this connector's channel; every record is labelled with it.
    """

    def __init__(self, channel: Channel) -> None:
        """An empty recorder for ``channel``."""
        if channel not in CHANNELS:
            raise ValueError(f"channel {channel!r} is not one of {CHANNELS}")
        self.channel: Channel = channel
        self._lock = threading.Lock()
        self._data = StatsData()
        self._failures: dict[tuple[Direction, FailureKind], int] = {}

    def record_transfer(self, direction: Direction, duration_s: float, nbytes: int, descriptors: int) -> None:
        """One completed transfer (a failed one goes to `record_failure` instead)."""
        row = Transfer(self.channel, direction, max(0.0, float(duration_s)), int(nbytes), int(descriptors))
        with self._lock:
            self._data.transfers.append(row)

    def record_failure(self, direction: Direction, kind: FailureKind | BaseException) -> None:
        """One failed transfer; ``kind`` may be the error itself (classified by `classify_failure`)."""
        key = (direction, kind if isinstance(kind, FailureKind) else classify_failure(kind))
        with self._lock:
            self._failures[key] = self._failures.get(key, 0) + 1

    def record_pool_lookup(self, hit_tokens: int, miss_tokens: int) -> None:
        """One pool lookup: tokens the pool will load and prompt tokens it did not have."""
        with self._lock:
            self._data.pool_hit_tokens += max(0, int(hit_tokens))
            self._data.pool_miss_tokens += max(0, int(miss_tokens))

    @contextmanager
    def timed(self, direction: Direction, nbytes: int, descriptors: int) -> Iterator[None]:
        """Record the body as one transfer if it returns, as a failure (classified) if it raises."""
        start = time.perf_counter()
        try:
            yield
        except BaseException as exc:
            self.record_failure(direction, exc)
            raise
        self.record_transfer(direction, time.perf_counter() - start, nbytes, descriptors)

    def take(self) -> StatsData | None:
        """What was recorded since the last call (None if nothing), and start afresh."""
        with self._lock:
            data, failures = self._data, self._failures
            self._data, self._failures = StatsData(), {}
        data.failures.extend(Failure(self.channel, d, k, n) for (d, k), n in sorted(failures.items()))
        return None if data.is_empty() else data
