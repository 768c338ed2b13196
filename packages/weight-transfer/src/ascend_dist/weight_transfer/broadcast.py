"""One weight update over a `Collective`: the trainer's send and the worker's receive.

Runs in: the trainer (`send_update`, rank 0) and every inference worker (`receive_update`).

Collective order of one update (every rank, in this order):

1. header: int64 ``[MAGIC, PROTOCOL_VERSION, update_id, manifest_len]`` broadcast from rank 0;
2. the trainer's manifest (msgpack bytes) broadcast from rank 0;
3. verdict: an int64 vector of ``world_size`` summed across ranks; worker ``r`` writes 1 in slot
   ``r`` if the manifest differs from its own (and puts the difference in the store). Any 1: every
   rank stops, the trainer raises `ManifestMismatch` quoting the workers, nothing was written;
4. data: packed, the byte stream (see `packing`) in fixed-size buffers, ``num_buffers`` in flight
   on both sides; unpacked, one broadcast per tensor;
5. commit vote: the same vector again; a worker votes 0 once every byte is in its staging tensors.
   Only when all votes are 0 does any worker load the staged tensors into the model;
6. load vote (staged updates): a worker votes 1 if the model's loader raised (a fault the checks
   before step 3 cannot see); its host restore point of the model (`restore`) was copied during
   step 4, while the bytes were on the wire (it reads only the model, which step 4 never writes);
7. only when a rank voted 1 in step 6: every worker restores its restore point and votes 1 in a
   restore vote if it could not. All restored: every rank raises `LoadRestored` (previous weights
   on every rank, the group usable); otherwise `LoadFailed` naming the ranks with mixed weights.

Workers receive into staging tensors, never into the model, so a failure anywhere before the
commit (a worker dying, a timeout, a mismatch) leaves every surviving worker on its previous
weights, and a loader failure after it is undone on every rank (steps 6-7). The trainer turns a
failed collective into `WorkerLost` naming the workers whose heartbeat stopped, or `UpdateAborted`
when all are alive.

Streamed updates (``Manifest.streamed``) trade that atomicity for bounded memory: steps 1-3 are the
same (the name check still refuses before any byte), then step 4 carries buckets of whole tensors
(`packing.plan_buckets`) through ``num_buffers`` buffers on each side, and each worker loads a
bucket into the model as soon as it landed, while the next ones are on the wire and the trainer
packs the one after. Neither side holds more than ``num_buffers * buffer_size_bytes`` of buffers;
the engines keep them between updates in their `BufferPool` (on the CPU a fresh buffer costs page
faults as long as its wire time) and free them at shutdown. A bucket that is one contiguous source
tensor is broadcast from that tensor, without the pack copy. Step 5 then reports whether every rank loaded every
bucket: a worker whose loader failed keeps receiving (so the group stays in step) and votes no;
every rank raises `LoadFailed`. A collective that fails after the first load is a `PartialUpdate`:
the survivors hold some new weights.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from ascend_dist.common.errors import AscendDistError, ProtocolError
from ascend_dist.weight_transfer.collective import Collective, Pending
from ascend_dist.weight_transfer.errors import (
    LoadFailed,
    LoadRestored,
    ManifestMismatch,
    ManifestRejected,
    PartialUpdate,
    UpdateAborted,
)
from ascend_dist.weight_transfer.messages import (
    PROTOCOL_VERSION,
    Manifest,
    check_manifests,
    decode_manifest,
    encode_manifest,
)
from ascend_dist.weight_transfer.packing import (
    Bucket,
    LazyImages,
    StreamPlan,
    as_bytes,
    bucket_views,
    check_tensor,
    direct_image,
    expect_end,
    next_tensor,
    pack_buffer,
    pack_images,
    plan_buckets,
    plan_stream,
    pull_bucket,
    spec_nbytes,
    tensor_views,
)
from ascend_dist.weight_transfer.pool import Allocate, BufferPool, device_allocator
from ascend_dist.weight_transfer.session import RestorableSink, Snapshot, WeightSink

if TYPE_CHECKING:
    import torch

__all__ = ["MAGIC", "Phases", "receive_update", "send_update"]

logger = logging.getLogger(__name__)

MAGIC: Final[int] = 0x5754_5846  # "WTXF"
_SRC: Final[int] = 0


@dataclass
class Phases:
    """Seconds spent per phase of one update on one side (for the bench split)."""

    pack_s: float = 0.0
    transfer_s: float = 0.0
    load_s: float = 0.0
    bytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def _int64(values: list[int], device: torch.device) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.int64, device=device)


def _vote(comm: Collective, slot_value: int) -> list[int]:
    """Sum a one-hot status vector: everyone learns every rank's status."""
    votes = _int64([0] * comm.world_size, comm.device)
    votes[comm.rank] = slot_value
    comm.all_reduce_sum(votes)
    return [int(v) for v in votes.tolist()]


def _exchange_manifest(comm: Collective, manifest: Manifest | None, update_id: int) -> tuple[int, Manifest]:
    """Steps 1-2: rank 0 sends its manifest; everyone returns (update_id, trainer manifest)."""
    import torch

    payload = encode_manifest(manifest) if manifest is not None else b""
    header = _int64([MAGIC, PROTOCOL_VERSION, update_id, len(payload)], comm.device)
    comm.broadcast(header, _SRC).wait()
    magic, version, uid, length = (int(v) for v in header.tolist())
    if magic != MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError(f"weight-update header magic={magic:#x} version={version}: not this protocol")
    if manifest is None:
        raw = torch.empty(length, dtype=torch.uint8, device=comm.device)
        comm.broadcast(raw, _SRC).wait()
        return uid, decode_manifest(raw.cpu().numpy().tobytes())
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(comm.device)
    comm.broadcast(raw, _SRC).wait()
    return uid, manifest


def _slots(comm: Collective, manifest: Manifest, plan: StreamPlan, pool: BufferPool) -> list[torch.Tensor]:
    """The pipeline buffers: ``num_buffers`` of them, no larger than the largest packed unit (kept in ``pool``)."""
    packed = [u.end - u.start for u in plan.units if not u.direct]
    size = max(packed, default=0)
    count = min(manifest.num_buffers, len(packed))
    return [pool.get(f"slot{i}", size, comm.device) for i in range(count)]


def _send_packed(
    comm: Collective, manifest: Manifest, source: Iterator[tuple[str, Any]], phases: Phases, pool: BufferPool
) -> None:
    """Send every unit: packed ones through reusable slots, direct ones from the tensor itself.

    At most ``num_buffers`` collectives are in flight; each keeps its memory (slot or tensor image)
    referenced until it completed, so nothing is reused or freed under a running broadcast.
    """
    plan = plan_stream(manifest)
    puller = LazyImages(plan, manifest, source)
    slots = _slots(comm, manifest, plan, pool)
    free = list(range(len(slots)))
    in_flight: collections.deque[tuple[Pending, int | None, torch.Tensor]] = collections.deque()

    def retire() -> None:
        pending, slot, _memory = in_flight.popleft()
        t0 = time.perf_counter()
        pending.wait()
        phases.transfer_s += time.perf_counter() - t0
        if slot is not None:
            free.append(slot)

    for k, unit in enumerate(plan.units):
        while len(in_flight) >= manifest.num_buffers or (not unit.direct and not free):
            retire()
        images = puller.upto(k)
        if unit.direct:
            (piece,) = plan.pieces(k)
            memory = images[piece.tensor_index]
            assert memory is not None
            in_flight.append((comm.broadcast(memory, _SRC), None, memory))
            continue
        slot = free.pop()
        t0 = time.perf_counter()
        length = pack_buffer(plan, k, images, slots[slot])
        phases.pack_s += time.perf_counter() - t0
        in_flight.append((comm.broadcast(slots[slot][:length], _SRC), slot, slots[slot]))
    while in_flight:
        retire()
    puller.rest()
    phases.bytes = plan.total_bytes


def _bucket_slots(
    comm: Collective, manifest: Manifest, buckets: tuple[Bucket, ...], pool: BufferPool | None, allocate: Allocate
) -> list[torch.Tensor]:
    """A streamed update's buffers: ``num_buffers`` of them, no larger than the largest bucket.

    From ``pool`` (kept between updates, keys ``bucket0..``) when given, else fresh from ``allocate``
    for this update only. Either way at most ``num_buffers`` of them exist: a pool holds no other
    streamed buffers, and `BufferPool.get` frees a buffer of another size before allocating its
    replacement.
    """
    size = max((b.length for b in buckets), default=0)
    count = min(manifest.num_buffers, len(buckets))
    if pool is None:
        return [allocate(size, comm.device) for _ in range(count)]
    return [pool.get(f"bucket{i}", size, comm.device) for i in range(count)]


def _send_streamed(
    comm: Collective,
    manifest: Manifest,
    source: Iterator[tuple[str, Any]],
    phases: Phases,
    *,
    pool: BufferPool | None,
    allocate: Allocate,
) -> None:
    """Pack bucket ``k + 1`` while bucket ``k`` is on the wire; pull each tensor only when its bucket is packed.

    Nothing is imaged ahead: a tensor's bytes are read when they are copied into its bucket, so the
    trainer's extra memory is the ``num_buffers`` buffers (plus one tensor's contiguous copy when the
    source tensor is not contiguous). A bucket whose bytes are one contiguous tensor on the group's
    device is broadcast from that tensor (`direct_image`): the same bytes, no pack copy. At most
    ``num_buffers`` broadcasts are in flight either way.
    """
    t0 = time.perf_counter()
    buckets = plan_buckets(manifest)
    slots = _bucket_slots(comm, manifest, buckets, pool, allocate)
    free = list(range(len(slots)))
    in_flight: collections.deque[tuple[Pending, int | None, torch.Tensor | None]] = collections.deque()
    phases.extra["setup_s"] = phases.extra.get("setup_s", 0.0) + time.perf_counter() - t0
    direct = 0

    def retire() -> None:
        pending, slot, _memory = in_flight.popleft()  # _memory: a direct send's tensor, referenced until done
        t0 = time.perf_counter()
        pending.wait()
        phases.transfer_s += time.perf_counter() - t0
        if slot is not None:
            free.append(slot)

    for bucket in buckets:
        while len(in_flight) >= len(slots) or not free:
            retire()
        t0 = time.perf_counter()
        images = pull_bucket(bucket, source, manifest)
        image = direct_image(bucket, images, comm.device)
        if image is not None:
            phases.pack_s += time.perf_counter() - t0
            in_flight.append((comm.broadcast(image, _SRC), None, image))
            direct += 1
            continue
        slot = free.pop()
        buffer = slots[slot]
        pack_images(buffer, bucket, images)
        del images
        phases.pack_s += time.perf_counter() - t0
        if bucket.length:
            in_flight.append((comm.broadcast(buffer[: bucket.length], _SRC), slot, None))
        else:
            free.append(slot)
    while in_flight:
        retire()
    expect_end(source, manifest)
    phases.bytes = sum(spec_nbytes(s) for s in manifest.tensors)
    phases.extra["direct_buckets"] = float(direct)


def _send_unpacked(comm: Collective, manifest: Manifest, source: Iterator[tuple[str, Any]], phases: Phases) -> None:
    total = 0
    for index, spec in enumerate(manifest.tensors):
        name, tensor = next_tensor(source, manifest, index)
        check_tensor(spec, name, tensor, index)
        image = as_bytes(tensor.to(comm.device))
        if image.numel():
            t0 = time.perf_counter()
            comm.broadcast(image, _SRC).wait()
            phases.transfer_s += time.perf_counter() - t0
        total += image.numel()
    expect_end(source, manifest)
    phases.bytes = total


def send_update(
    comm: Collective,
    manifest: Manifest,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    update_id: int,
    rejection_detail: Callable[[int, int], str],
    pool: BufferPool | None = None,
    allocate: Allocate = device_allocator,
) -> Phases:
    """Run one update as the trainer (rank 0).

    Args:
        comm: The transfer group's collective.
        manifest: What is sent, in order; ``tensors`` must match it exactly.
        tensors: ``(name, tensor)`` pairs in manifest order (consumed lazily).
        update_id: Sequence number of the update (for logs and store keys).
        rejection_detail: ``(update_id, worker_rank) -> str``: the reason a worker gave.
        pool: Keeps the pipeline buffers between updates (default: fresh ones for this update);
            streamed updates keep their ``num_buffers`` bucket buffers there too.
        allocate: Where a streamed update's buffers come from when there is no ``pool`` (then
            they are dropped when the update ends).

    Returns:
        Time split of the update.

    Raises:
        ManifestMismatch: A worker refused the manifest (nothing was sent or written), or the
            source disagrees with the manifest (workers time out and keep their weights).
        RuntimeError: The collective failed (the caller maps it to `WorkerLost`/`UpdateAborted`).
        LoadFailed: Streamed: a worker's loader failed; the others loaded the whole update.
    """
    phases = Phases()
    t0 = time.perf_counter()
    _exchange_manifest(comm, manifest, update_id)
    votes = _vote(comm, 0)
    phases.extra["setup_s"] = time.perf_counter() - t0  # manifest exchange and the name vote
    rejected = [r for r, v in enumerate(votes) if v]
    if rejected:
        reasons = "; ".join(f"worker rank {r}: {rejection_detail(update_id, r)}" for r in rejected)
        raise ManifestRejected(f"update {update_id} refused before any data was sent ({reasons})")
    source = iter(tensors)
    if manifest.streamed:
        _send_streamed(comm, manifest, source, phases, pool=pool, allocate=allocate)
    elif manifest.packed:
        _send_packed(comm, manifest, source, phases, pool if pool is not None else BufferPool(device_allocator))
    else:
        _send_unpacked(comm, manifest, source, phases)
    t0 = time.perf_counter()
    votes = _vote(comm, 0)
    phases.extra["final_vote_s"] = time.perf_counter() - t0  # streamed: the workers' last loads
    phases.transfer_s += phases.extra["final_vote_s"]
    failed = [r for r, v in enumerate(votes) if v]
    if failed and manifest.streamed:
        raise LoadFailed(
            f"update {update_id} (streamed): worker ranks {failed} could not load every bucket; the other "
            "workers loaded all of it, so the ranks now hold different weights: send a complete update again"
        )
    if failed:
        raise UpdateAborted(f"update {update_id}: workers {failed} did not receive every byte; none committed")
    if not manifest.streamed:
        _settle_load(comm, update_id, None, None)
    return phases


def _recv_unpacked(comm: Collective, manifest: Manifest, phases: Phases, flat: torch.Tensor) -> list[torch.Tensor]:
    """Receive one broadcast per tensor, each into its place in the staging stream ``flat``."""
    plan = plan_stream(manifest)
    t0 = time.perf_counter()
    for offset, size in zip(plan.offsets, plan.sizes, strict=True):
        if size:
            comm.broadcast(flat[offset : offset + size], _SRC).wait()
    phases.transfer_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    views = tensor_views(flat, plan, manifest)
    phases.pack_s += time.perf_counter() - t0
    phases.bytes = plan.total_bytes
    return views


def _recv_packed(
    comm: Collective, manifest: Manifest, phases: Phases, flat: torch.Tensor, meanwhile: Callable[[], None]
) -> list[torch.Tensor]:
    """Receive the stream straight into the staging stream ``flat``, ``num_buffers`` receives in flight.

    ``meanwhile`` runs once the first receives are posted, while the bytes are on the wire.
    """
    plan = plan_stream(manifest)
    depth = manifest.num_buffers
    posted: dict[int, Pending] = {}

    def post(k: int) -> None:
        start = plan.unit_start(k)
        posted[k] = comm.broadcast(flat[start : start + plan.buffer_length(k)], _SRC)

    for k in range(min(depth, plan.num_buffers)):
        post(k)
    meanwhile()
    t0 = time.perf_counter()
    for k in range(plan.num_buffers):
        posted.pop(k).wait()
        if k + depth < plan.num_buffers:
            post(k + depth)
    phases.transfer_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    views = tensor_views(flat, plan, manifest)
    phases.pack_s += time.perf_counter() - t0
    phases.bytes = plan.total_bytes
    return views


def _recv_streamed(
    comm: Collective,
    manifest: Manifest,
    phases: Phases,
    sink: WeightSink,
    *,
    pool: BufferPool | None,
    allocate: Allocate,
) -> BaseException | None:
    """Receive bucket after bucket, loading each into ``sink`` while the next ones are on the wire.

    Returns the loader's error (the first one; later buckets are still received, not loaded, so
    every rank stays in step for the final vote) or None.

    Raises:
        PartialUpdate: The collective failed after a bucket was loaded (cause: its error).
    """
    t_start = time.perf_counter()
    buckets = plan_buckets(manifest)
    slots = _bucket_slots(comm, manifest, buckets, pool, allocate)
    depth = len(slots)
    posted: dict[int, Pending] = {}
    load_error: BaseException | None = None
    loaded = 0

    def post(k: int) -> None:
        if buckets[k].length:
            posted[k] = comm.broadcast(slots[k % depth][: buckets[k].length], _SRC)

    try:
        for k in range(depth):
            post(k)
        for k, bucket in enumerate(buckets):
            pending = posted.pop(k, None)
            t0 = time.perf_counter()
            if pending is not None:
                pending.wait()
            t1 = time.perf_counter()
            phases.transfer_s += t1 - t0
            if not k:  # how long until the first bucket could load: the pipeline's fill time on this side
                phases.extra["first_bucket_s"] = t1 - t_start
            if load_error is None:
                loaded += 1  # counted before the call: a loader that fails midway changed the model too
                try:
                    sink.load_weights(bucket_views(slots[k % depth], bucket, manifest))
                except Exception as exc:  # the model's loader: any error; reported at the vote
                    load_error = exc
                phases.load_s += time.perf_counter() - t1
            if k + depth < len(buckets):
                post(k + depth)  # the slot is free: the sink copied bucket k out
    except (AscendDistError, RuntimeError) as exc:
        if not loaded:
            raise
        raise PartialUpdate(
            f"streamed update failed on the wire after {loaded} of {len(buckets)} buckets were loaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): this model holds some new "
            "weights; send a complete update again"
        ) from exc
    phases.bytes = sum(spec_nbytes(s) for s in manifest.tensors)
    return load_error


def _finish_streamed(comm: Collective, update_id: int, load_error: BaseException | None) -> None:
    """Step 5 of a streamed update: every rank learns whether every rank loaded every bucket."""
    try:
        votes = _vote(comm, 1 if load_error is not None else 0)
    except (AscendDistError, RuntimeError) as exc:
        raise PartialUpdate(
            f"update {update_id} (streamed): the final vote failed ({type(exc).__name__}) after this worker "
            "loaded buckets: it may hold new weights while other ranks do not; send a complete update again"
        ) from exc
    if load_error is not None:
        raise LoadFailed(
            f"update {update_id} (streamed): the model's loader failed on a bucket "
            f"({type(load_error).__name__}: {load_error}); earlier buckets were loaded, so the model holds "
            "mixed weights: send a complete update again"
        ) from load_error
    failed = [r for r, v in enumerate(votes) if v]
    if failed:
        raise LoadFailed(
            f"update {update_id} (streamed): ranks {failed} could not load every bucket; this rank loaded all "
            "of it, so the ranks hold different weights: send a complete update again"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]


def _settle_load(comm: Collective, update_id: int, load_error: BaseException | None, snapshot: Snapshot | None) -> None:
    """Steps 6-7 of a staged update: every rank learns whether every worker loaded; if one did not, all restore.

    The trainer (rank 0) loads nothing: it votes 0 and raises what the workers concluded.

    Raises:
        LoadRestored: A worker's loader failed; every worker restored its previous weights.
        LoadFailed: A worker's loader failed and some worker could not restore (named): mixed weights.
        UpdateAborted: A vote's collective failed after the load (a rank died); this worker restored.
        PartialUpdate: The same, and this worker could not restore.
    """
    worker = comm.rank != _SRC
    try:
        failed = [r for r, v in enumerate(_vote(comm, 1 if load_error is not None else 0)) if v]
        if not failed:
            return
        restore_error: BaseException | str | None = None
        if worker:
            restore_error = _restore(snapshot)
        unrestored = [r for r, v in enumerate(_vote(comm, 1 if restore_error is not None else 0)) if v]
    except (AscendDistError, RuntimeError) as exc:
        if not worker:
            raise  # the trainer's caller names the lost workers
        restore_error = _restore(snapshot)
        if restore_error is None:
            raise UpdateAborted(
                f"update {update_id}: a vote after the load failed ({_first_line(exc)}); this worker restored "
                "its previous weights"
            ) from exc
        raise PartialUpdate(
            f"update {update_id}: a vote after the load failed ({_first_line(exc)}) and this worker could not "
            f"restore its previous weights ({restore_error}): it may hold new weights; send a complete update again"
        ) from exc
    here = f"; here: {_first_line(load_error)}" if load_error is not None else ""
    what = f"update {update_id}: the model's loader failed after the commit vote on worker ranks {failed}{here}"
    if not unrestored:
        raise LoadRestored(f"{what}; every rank restored its previous weights") from load_error
    why = f" ({restore_error})" if worker and restore_error is not None else ""
    raise LoadFailed(
        f"{what}; worker ranks {unrestored} could not restore their previous weights{why} and may hold mixed "
        "weights: do not serve from them; send a complete update again or restart them"
    ) from load_error


@dataclass(frozen=True)
class _MissingSnapshot:
    """The restore point that could not be taken, and why."""

    reason: str

    def restore(self) -> None:
        """Raises: RuntimeError: Always: there is nothing to restore from."""
        raise RuntimeError(f"no restore point: taking it failed ({self.reason})")


def _restore(snapshot: Snapshot | None) -> str | None:
    """Put the restore point back; the reason it could not be, or None."""
    if snapshot is None:
        return "no restore point: restoring is turned off"
    try:
        snapshot.restore()
    except Exception as exc:  # the model's own tensors refused the copy: report, never hide
        logger.exception("restoring the previous weights failed")
        return _first_line(exc)
    return None


def receive_update(
    comm: Collective,
    expected: Manifest | None,
    sink: WeightSink,
    *,
    reject: Callable[[int, str], None],
    refuse: str = "",
    validate: Callable[[Manifest], None] | None = None,
    pool: BufferPool | None = None,
    allocate: Allocate = device_allocator,
) -> tuple[int, Phases]:
    """Run one update as a worker; load the weights only if every rank got every byte.

    Args:
        comm: The transfer group's collective.
        expected: The manifest this worker built from its update info and init parameters (None
            when it could not build one: then ``refuse`` says why, and the worker votes no).
        sink: Receives the staged tensors at commit (``load_weights``).
        reject: ``(update_id, reason)``: publish why this worker refuses (before the vote).
        refuse: A reason to refuse whatever the trainer sends (bad local update info).
        validate: Optional check of the manifest against the model (unknown names, shapes, dtypes).
        pool: Keeps the staging stream between updates (default: a fresh one for this update);
            streamed updates keep their ``num_buffers`` bucket buffers there instead.
            ``sink`` must copy what it is given before ``load_weights`` returns.
        allocate: Where a streamed update's buffers come from when there is no ``pool`` (then
            they are dropped when the update ends).

    Returns:
        ``(update_id, phases)``.

    Raises:
        ManifestMismatch: This worker or another refused the update; nothing was written.
        UpdateAborted: The update did not complete on every rank; the model keeps its weights.
        LoadFailed: Streamed: a rank's loader failed (this one's error is the cause).
        PartialUpdate: Streamed: the collective failed after this worker loaded a bucket.
    """
    phases = Phases()
    t0 = time.perf_counter()
    update_id, remote = _exchange_manifest(comm, None, 0)
    reason = refuse
    try:
        if expected is not None and not reason:
            check_manifests(expected, remote, local_role="worker", remote_role="trainer")
            if validate is not None:
                validate(remote)
    except ManifestMismatch as exc:
        reason = str(exc)
    if reason:
        reject(update_id, reason)
    votes = _vote(comm, 1 if reason else 0)
    phases.extra["setup_s"] = time.perf_counter() - t0  # manifest exchange, checks and the name vote
    if reason:
        raise ManifestRejected(f"update {update_id} refused: {reason}")
    if any(votes):
        others = [r for r, v in enumerate(votes) if v]
        raise ManifestRejected(f"update {update_id} refused by worker ranks {others}; nothing was written")
    if remote.streamed:
        load_error = _recv_streamed(comm, remote, phases, sink, pool=pool, allocate=allocate)
        t0 = time.perf_counter()
        _finish_streamed(comm, update_id, load_error)
        phases.extra["final_vote_s"] = time.perf_counter() - t0
        return update_id, phases
    _recv_staged(comm, update_id, remote, phases, sink, pool=pool)
    return update_id, phases


def _recv_staged(
    comm: Collective, update_id: int, remote: Manifest, phases: Phases, sink: WeightSink, *, pool: BufferPool | None
) -> None:
    """Steps 4-7 of a staged update on a worker: receive into staging, commit vote, load, load vote."""
    total = sum(spec_nbytes(spec) for spec in remote.tensors)
    flat = (pool if pool is not None else BufferPool(device_allocator)).get("staging", total, comm.device)
    snapshots: list[Snapshot | None] = []

    def take_snapshot() -> None:
        t0 = time.perf_counter()
        try:
            snapshots.append(sink.snapshot() if isinstance(sink, RestorableSink) else None)
        except Exception as exc:  # e.g. no host memory: the update goes on; a failed load then reports it
            logger.exception("update %d: taking the restore point failed", update_id)
            snapshots.append(_MissingSnapshot(_first_line(exc)))
        phases.extra["snapshot_s"] = time.perf_counter() - t0  # the restore point's host copy, apart from the load

    if remote.packed:  # the restore point is copied while the bytes are on the wire (it reads only the model)
        staging = _recv_packed(comm, remote, phases, flat, take_snapshot)
    else:
        staging = _recv_unpacked(comm, remote, phases, flat)
        take_snapshot()
    t0 = time.perf_counter()
    votes = _vote(comm, 0)
    phases.transfer_s += time.perf_counter() - t0
    if any(votes):
        raise UpdateAborted(f"update {update_id}: ranks {[r for r, v in enumerate(votes) if v]} failed; not committed")
    snapshot = snapshots[0]
    t0 = time.perf_counter()
    load_error: BaseException | None = None
    try:
        sink.load_weights([(spec.name, t) for spec, t in zip(remote.tensors, staging, strict=True)])
    except Exception as exc:  # the model's loader, any error: every rank learns it at the load vote
        load_error = exc
    phases.load_s = time.perf_counter() - t0
    _settle_load(comm, update_id, load_error, snapshot)
