"""Messages of the recompute connector and of native offloading's failures.

Runs in: the scheduler (builds `RecomputeMetadata`, consumes `RecomputeWorkerMeta` and
`NativeFailedStores`) and every worker (the reverse). vLLM carries these objects between processes;
each is a frozen msgspec Struct with a ``version`` field that the decoder checks, so a worker of
another release is refused by name rather than misreading a field.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from ascend_dist.common.errors import IncompatiblePeer
from ascend_dist.common.wire import Codec

__all__ = [
    "METADATA_VERSION",
    "NO_EVENT",
    "NativeFailedStores",
    "RecomputeMetadata",
    "RecomputeWorkerMeta",
    "decode_failed_stores",
    "decode_metadata",
    "decode_worker_meta",
    "encode_failed_stores",
    "encode_message",
]

METADATA_VERSION = 1
"""Bumped whenever a field of these messages changes meaning."""

NO_EVENT = -1
"""Event index meaning "no transfer of this direction this step"."""


class RecomputeMetadata(msgspec.Struct, frozen=True, kw_only=True, tag="recompute-meta"):
    """Scheduler -> workers, once per step.

    Attributes:
        need_flush: some request was preempted this step (run the store in ``handle_preemptions``).
        store_event: index of this step's store, or -1.
        store_gpu_blocks / store_cpu_blocks: the store's block pairs (device -> host).
        load_event: index of this step's load, or -1.
        load_gpu_blocks / load_cpu_blocks: the load's block pairs (host -> device).
        load_event_to_reqs: every load in flight -> its request ids.
    """

    version: int = METADATA_VERSION
    need_flush: bool = False
    store_event: int = NO_EVENT
    store_gpu_blocks: tuple[int, ...] = ()
    store_cpu_blocks: tuple[int, ...] = ()
    load_event: int = NO_EVENT
    load_gpu_blocks: tuple[int, ...] = ()
    load_cpu_blocks: tuple[int, ...] = ()
    load_event_to_reqs: dict[int, tuple[str, ...]] = msgspec.field(default_factory=dict)


class RecomputeWorkerMeta(msgspec.Struct, frozen=True, kw_only=True, tag="recompute-worker-meta"):
    """Worker -> scheduler, once per step; the engine sums the workers' payloads with `aggregate`.

    Attributes:
        completed_stores: store event -> number of workers that finished it.
        failed_stores: store events that failed on some worker (their requests fall back to recompute).
    """

    version: int = METADATA_VERSION
    completed_stores: dict[int, int] = msgspec.field(default_factory=dict)
    failed_stores: tuple[int, ...] = ()

    def aggregate(self, other: RecomputeWorkerMeta) -> RecomputeWorkerMeta:
        """Sum per-event counts and union the failures of two workers' payloads."""
        counts = dict(self.completed_stores)
        for event, n in other.completed_stores.items():
            counts[event] = counts.get(event, 0) + n
        failed = tuple(sorted(set(self.failed_stores) | set(other.failed_stores)))
        return RecomputeWorkerMeta(completed_stores=counts, failed_stores=failed)


class NativeFailedStores(msgspec.Struct, frozen=True, kw_only=True, tag="native-failed-stores"):
    """Worker -> scheduler (native offloading): store jobs whose copy failed on some worker.

    Attributes:
        job_ids: the scheduler's store job ids, sorted.
    """

    version: int = METADATA_VERSION
    job_ids: tuple[int, ...] = ()


_META = Codec(RecomputeMetadata)
_WORKER = Codec(RecomputeWorkerMeta)
_FAILED = Codec(NativeFailedStores)


def encode_message(msg: RecomputeMetadata | RecomputeWorkerMeta) -> bytes:
    """Msgpack bytes of either message."""
    return _META.encode(msg) if isinstance(msg, RecomputeMetadata) else _WORKER.encode(msg)


def _check_version(msg: RecomputeMetadata | RecomputeWorkerMeta | NativeFailedStores) -> None:
    if msg.version != METADATA_VERSION:
        raise IncompatiblePeer("version", METADATA_VERSION, msg.version)


def decode_metadata(data: bytes) -> RecomputeMetadata:
    """Decode and version-check scheduler metadata.

    Raises:
        ProtocolError: malformed or oversized bytes.
        IncompatiblePeer: another metadata version.
    """
    msg = _META.decode(data)
    _check_version(msg)
    return msg


def decode_worker_meta(data: bytes) -> RecomputeWorkerMeta:
    """Decode and version-check a worker payload (same errors as `decode_metadata`)."""
    msg = _WORKER.decode(data)
    _check_version(msg)
    return msg


def encode_failed_stores(job_ids: Iterable[int]) -> bytes:
    """Msgpack bytes of the failed store jobs (empty bytes when there are none)."""
    ids = tuple(sorted({int(j) for j in job_ids}))
    return _FAILED.encode(NativeFailedStores(job_ids=ids)) if ids else b""


def decode_failed_stores(data: bytes) -> frozenset[int]:
    """The failed store job ids of a worker payload (empty bytes: none).

    Raises:
        ProtocolError: malformed or oversized bytes.
        IncompatiblePeer: another metadata version.
    """
    if not data:
        return frozenset()
    msg = _FAILED.decode(data)
    _check_version(msg)
    return frozenset(msg.job_ids)
