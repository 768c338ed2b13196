"""Worker side of the same-chip IPC engine (backend ``npu_ipc``), without vLLM.

Runs in: each inference worker colocated with a trainer rank. Call order:

    init({"packed": ..., "buffer_size_bytes": ...})  ->  start()  ->  update(payload) [...]  ->  finish()

Unpacked: one ``update`` carries a handle per tensor; every handle is opened (zero-copy views of
the trainer's memory) before anything is loaded, then all tensors are loaded at once. Packed: each
``update`` carries one chunk of the byte stream in the trainer's reused buffer; the worker copies it
into staging tensors and loads them into the model when the last chunk arrives (upstream's packed
path never loaded them). A chunk out of order, a different manifest mid-update, or a handle for
another chip is refused with a typed error, and the staged bytes are dropped.

Loader failures (issue 25 item 4): before a staged update is loaded the worker takes a host restore
point of the model (`session.RestorableSink.snapshot`) and puts it back when the loader raises
(`LoadRestored`). Each rank of a replica is driven by its own RPC, so with ``peers`` > 1 the ranks
agree through a `load_vote.LoadVote` after loading: every rank keeps the update, or every rank
restores and raises `LoadRestored` naming the failing ranks (a rank that dropped the update earlier
votes no at once). Without a vote (none given, or a trainer that sends no ``update_id``) the
failing rank restores its part and refuses to run (`guard`) until a complete update succeeds,
raising `LoadFailed`, since the others may hold the new weights. A streamed update that fails
after a chunk was loaded (or a restore that fails) trips the guard too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from ascend_dist.common.device.ipc import IpcHandle
from ascend_dist.common.errors import ProtocolError
from ascend_dist.weight_transfer.errors import LoadFailed, LoadRestored, ManifestMismatch
from ascend_dist.weight_transfer.guard import WeightsGuard
from ascend_dist.weight_transfer.ipc import device_uuid, pick_handle
from ascend_dist.weight_transfer.load_vote import LoadVote
from ascend_dist.weight_transfer.messages import (
    IpcChunk,
    IpcParams,
    Manifest,
    ipc_chunk_from_builtins,
)
from ascend_dist.weight_transfer.packing import (
    bucket_views,
    new_staging,
    plan_buckets,
    plan_stream,
    staging_images,
    unpack_buffer,
)
from ascend_dist.weight_transfer.session import RestorableSink, Session, SessionState, Snapshot, WeightSink

if TYPE_CHECKING:
    import torch

    from ascend_dist.common.device import DeviceRuntime

__all__ = ["IpcWorker"]

logger = logging.getLogger(__name__)


class _Staged:
    """A packed update in progress: its manifest, staging tensors and the next chunk expected."""

    def __init__(self, manifest: Manifest, device: torch.device) -> None:
        self.manifest = manifest
        self.digest = manifest.digest()
        self.plan = plan_stream(manifest)
        self.staging = new_staging(manifest, device)
        self.images = staging_images(self.staging)
        self.next_chunk = 0


class _Streaming:
    """A streamed update in progress: its buckets and the next one expected (nothing staged)."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.digest = manifest.digest()
        self.buckets = plan_buckets(manifest)
        self.count = len(self.buckets) if any(b.length for b in self.buckets) else 0
        self.next_chunk = 0


class IpcWorker:
    """Receives weights through IPC handles from a trainer on the same chip and loads them."""

    def __init__(
        self,
        sink: WeightSink,
        runtime: DeviceRuntime,
        *,
        uuid: str | None = None,
        validate: Callable[[Manifest], None] | None = None,
        peers: int = 1,
        guard: WeightsGuard | None = None,
        vote: LoadVote | None = None,
    ) -> None:
        """Create the engine.

        Args:
            sink: Where weights are loaded (``load_weights``).
            runtime: Opens handles (shared memory on the CPU, device IPC on npu/cuda).
            uuid: This worker's chip identity; default `device_uuid` of the runtime's device.
            validate: Optional check of each manifest against the model before anything is loaded.
            peers: Ranks that load the same update, each through its own RPC (vLLM: the replica's
                TP x PP workers); above 1 a loader failure here cannot be undone everywhere
                without ``vote``.
            guard: Tripped while the model may hold mixed weights (install it on the model); a
                fresh one by default.
            vote: The replica's load vote (one per rank, ``peers`` ranks); None: no vote.
        """
        import torch

        self.sink = sink
        self.runtime = runtime
        self.device_index = runtime.device_index
        self.uuid = uuid if uuid is not None else device_uuid(runtime.device_index, runtime.name)
        self.device = torch.device("cpu") if runtime.name == "cpu" else torch.device(runtime.name, runtime.device_index)
        self._validate = validate
        self.peers = peers
        self.guard = guard if guard is not None else WeightsGuard()
        self.vote = vote
        self._update_id = ""  # of the chunk being applied: names its load vote
        self.session = Session("npu_ipc weight transfer")
        self.params = IpcParams()
        self._staged: _Staged | None = None
        self._streaming: _Streaming | None = None
        self._opened: dict[tuple[bytes, int], torch.Tensor] = {}

    def init(self, params: IpcParams) -> None:
        """Record the trainer's must-agree parameters (``packed``, buffer size)."""
        self.session.require("init")
        self.params = params
        self.session.move(SessionState.READY)

    def start(self) -> None:
        """Open an update (raises `UpdateStateError` if one is open)."""
        self.session.require("start")
        self._staged = self._streaming = None
        self.session.move(SessionState.ACTIVE)

    def update(self, payload: dict[str, Any]) -> None:
        """Apply one update message (``{"chunk": <IpcChunk as JSON builtins>}``).

        Raises:
            UpdateStateError: No update is active.
            ProtocolError: Malformed payload, or a chunk out of order.
            ManifestMismatch: Mode or buffer size differ from init, or the manifest changed mid-update.
            ConfigError: No handle for this chip.
        """
        self.session.require("update")
        self._update_id = ""  # set from the chunk once it parses
        try:
            raw = payload.get("chunk")
            if not isinstance(raw, dict):
                raise ProtocolError("update payload lacks the 'chunk' object")
            self._apply(ipc_chunk_from_builtins(raw))
        except Exception as exc:
            self._staged = None  # drop half-received bytes; the model was not touched (or was restored)
            if not self.params.streamed:  # peers reaching this update's load vote restore at once (no-op once voted)
                self._withdraw(f"{type(exc).__name__}: {exc}")
            streaming, self._streaming = self._streaming, None
            self.session.move(SessionState.READY)
            if streaming is not None and streaming.next_chunk and not isinstance(exc, LoadFailed):
                failed = LoadFailed(
                    f"streamed update failed after {streaming.next_chunk} of {streaming.count} chunks were loaded "
                    f"({type(exc).__name__}: {exc}): the model holds mixed weights; send a complete update again"
                )
                self.guard.trip(f"{type(failed).__name__}: {failed}")
                raise failed from exc
            if isinstance(exc, LoadFailed):  # LoadRestored is not one: the previous weights are back
                cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ is not None else ""
                self.guard.trip(f"{type(exc).__name__}: {exc}{cause}")
            raise

    def _withdraw(self, reason: str) -> None:
        vote = self.vote
        if vote is None or not self._update_id:
            return
        try:
            vote.withdraw(self._update_id, reason)
        except Exception:  # the peers' vote then ends at its deadline instead: restore, not commit
            logger.warning("npu_ipc: could not withdraw from load vote %s", self._update_id, exc_info=True)

    def _apply(self, chunk: IpcChunk) -> None:
        self._update_id = chunk.update_id
        manifest = chunk.manifest
        if manifest.packed != self.params.packed:
            raise ManifestMismatch(f"packed: worker has {self.params.packed!r}, trainer sent {manifest.packed!r}")
        if manifest.packed and manifest.buffer_size_bytes != self.params.buffer_size_bytes:
            raise ManifestMismatch(
                f"buffer_size_bytes: worker has {self.params.buffer_size_bytes}, "
                f"trainer sent {manifest.buffer_size_bytes}"
            )
        if manifest.streamed != self.params.streamed:
            raise ManifestMismatch(f"streamed: worker has {self.params.streamed!r}, trainer sent {manifest.streamed!r}")
        if manifest.streamed:
            self._apply_streamed(chunk)
        elif manifest.packed:
            self._apply_packed(chunk)
        else:
            self._apply_unpacked(chunk)

    def _open(self, handles: dict[str, IpcHandle]) -> torch.Tensor:
        handle = pick_handle(handles, self.uuid, self.device_index)
        key = (handle.payload, handle.offset)
        view = self._opened.get(key)
        if view is None or tuple(view.shape) != handle.shape or str(view.dtype) != f"torch.{handle.dtype}":
            view = self.runtime.open_ipc_handle(handle)
            self._opened[key] = view
        return view

    def _apply_unpacked(self, chunk: IpcChunk) -> None:

        manifest = chunk.manifest
        if len(chunk.handles) != len(manifest.tensors):
            raise ProtocolError(f"{len(chunk.handles)} handles for {len(manifest.tensors)} tensors")
        if self._validate is not None:
            self._validate(manifest)
        pairs: list[tuple[str, torch.Tensor]] = []
        for spec, handles in zip(manifest.tensors, chunk.handles, strict=True):
            if not handles:  # a zero-byte tensor has no memory to share
                pairs.append((spec.name, new_staging(Manifest(tensors=(spec,)), self.device)[0]))
                continue
            view = self._open(handles)
            if tuple(view.shape) != spec.shape or str(view.dtype) != f"torch.{spec.dtype}":
                raise ManifestMismatch(
                    f"handle of {spec.name!r} describes {view.dtype}{tuple(view.shape)}, manifest {spec}"
                )
            pairs.append((spec.name, view))
        self._load_staged(pairs)

    def _apply_packed(self, chunk: IpcChunk) -> None:
        staged = self._staged
        if chunk.chunk_index == 0:
            if self._validate is not None:
                self._validate(chunk.manifest)
            staged = self._staged = _Staged(chunk.manifest, self.device)
            if staged.plan.num_buffers == 0:  # only zero-byte tensors: nothing to copy
                self._commit(staged)
                return
        if staged is None:
            raise ProtocolError(f"chunk {chunk.chunk_index} arrived before chunk 0 of its update")
        if chunk.manifest.digest() != staged.digest:
            raise ManifestMismatch(f"chunk {chunk.chunk_index} carries another manifest than chunk 0 of the update")
        if chunk.chunk_index != staged.next_chunk or chunk.num_chunks != staged.plan.num_buffers:
            raise ProtocolError(
                f"chunk {chunk.chunk_index}/{chunk.num_chunks} arrived, "
                f"expected {staged.next_chunk}/{staged.plan.num_buffers}"
            )
        if len(chunk.handles) != 1:
            raise ProtocolError(f"a packed chunk carries one buffer handle, got {len(chunk.handles)}")
        buffer = self._open(chunk.handles[0])
        if buffer.numel() != staged.plan.buffer_length(chunk.chunk_index):
            raise ProtocolError(
                f"chunk {chunk.chunk_index} buffer has {buffer.numel()} bytes, "
                f"expected {staged.plan.buffer_length(chunk.chunk_index)}"
            )
        unpack_buffer(staged.plan, chunk.chunk_index, buffer, staged.images)  # a copy: the buffer is reused
        staged.next_chunk += 1
        if staged.next_chunk == staged.plan.num_buffers:
            self._commit(staged)

    def _apply_streamed(self, chunk: IpcChunk) -> None:
        """Load one bucket straight from the trainer's shared buffer (the sink copies it)."""
        streaming = self._streaming
        if chunk.chunk_index == 0:
            if self._validate is not None:
                self._validate(chunk.manifest)  # before anything is loaded
            streaming = self._streaming = _Streaming(chunk.manifest)
            if streaming.count == 0:  # no bytes: load the empty tensors, done
                self.sink.load_weights(
                    list(
                        zip(
                            (s.name for s in chunk.manifest.tensors),
                            new_staging(chunk.manifest, self.device),
                            strict=True,
                        )
                    )
                )
                self._streaming = None
                self.guard.clear()
                return
        if streaming is None:
            raise ProtocolError(f"chunk {chunk.chunk_index} arrived before chunk 0 of its update")
        if chunk.manifest.digest() != streaming.digest:
            raise ManifestMismatch(f"chunk {chunk.chunk_index} carries another manifest than chunk 0 of the update")
        if chunk.chunk_index != streaming.next_chunk or chunk.num_chunks != streaming.count:
            raise ProtocolError(
                f"chunk {chunk.chunk_index}/{chunk.num_chunks} arrived, "
                f"expected {streaming.next_chunk}/{streaming.count}"
            )
        if len(chunk.handles) != 1:
            raise ProtocolError(f"a streamed chunk carries one buffer handle, got {len(chunk.handles)}")
        bucket = streaming.buckets[chunk.chunk_index]
        buffer = self._open(chunk.handles[0])
        if buffer.numel() != bucket.length:
            raise ProtocolError(
                f"chunk {chunk.chunk_index} buffer has {buffer.numel()} bytes, expected {bucket.length}"
            )
        streaming.next_chunk += 1  # counted before the load: a loader failing midway changed the model too
        self.sink.load_weights(bucket_views(buffer, bucket, streaming.manifest))
        self.runtime.synchronize()  # the trainer refills the buffer once this call returns
        if streaming.next_chunk == streaming.count:
            self._streaming = None
            self.guard.clear()  # every bucket of a complete update loaded: one version again

    def _commit(self, staged: _Staged) -> None:
        """Load a fully received packed update into the model."""
        self._staged = None
        self._load_staged([(s.name, t) for s, t in zip(staged.manifest.tensors, staged.staging, strict=True)])

    def _load_staged(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Load a whole update; on a loader failure put the restore point back.

        Raises:
            LoadRestored: The loader failed; this worker (the only rank) is back on its previous weights.
            LoadFailed: The loader failed and this worker could not restore, or restored while other
                ranks may have loaded the update (``peers`` > 1); `update` then trips the guard.
        """
        snapshot = self.sink.snapshot() if isinstance(self.sink, RestorableSink) else None
        if self.vote is not None and self._update_id:
            self._load_voted(pairs, snapshot, self.vote)
            return
        exc = self._load(pairs)
        if exc is not None:
            what = f"the model's loader failed ({type(exc).__name__}: {exc})"
            if snapshot is None:
                raise LoadFailed(f"{what} and restoring is turned off: the model holds mixed weights") from exc
            restore_exc = self._restore(snapshot)
            if restore_exc is not None:
                raise LoadFailed(
                    f"{what} and restoring the previous weights failed ({type(restore_exc).__name__}: {restore_exc}): "
                    "the model holds mixed weights"
                ) from exc
            if self.peers > 1:
                raise LoadFailed(
                    f"{what}; this rank restored its previous weights, but the other ranks of the engine "
                    f"({self.peers - 1}) load each update independently and may hold the new ones"
                ) from exc
            raise LoadRestored(f"{what}; this worker restored its previous weights") from exc
        self.guard.clear()  # a complete update loaded: one version again

    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> Exception | None:
        """Load ``pairs`` and wait for the device; the loader's own error, or None."""
        try:
            self.sink.load_weights(pairs)
            self.runtime.synchronize()
        except Exception as raised:
            # the vLLM sink already wraps its loader's error in a LoadFailed: name (and chain) the loader's own
            cause = raised.__cause__
            return cause if isinstance(raised, LoadFailed) and isinstance(cause, Exception) else raised
        return None

    def _restore(self, snapshot: Snapshot) -> Exception | None:
        """Put the restore point back and wait for the device; the error if that failed, or None."""
        try:
            snapshot.restore()
            self.runtime.synchronize()
        except Exception as exc:
            return exc
        return None

    def _load_voted(self, pairs: list[tuple[str, torch.Tensor]], snapshot: Snapshot | None, vote: LoadVote) -> None:
        """Load, vote with the replica's other ranks, and keep the update only if every rank loaded it.

        Raises:
            LoadRestored: Some rank's loader failed (or it did not vote in time): every rank restores.
            LoadFailed: This rank could not restore (or restoring is off): it holds mixed weights.
        """
        own = self._load(pairs)
        failure = None if own is None else f"the model's loader failed ({type(own).__name__}: {own})"
        try:
            outcome = vote.vote(self._update_id, failure)
        except Exception as exc:  # the store is gone: the others may have committed or restored
            self._restore_unvoted(snapshot, vote.rank, exc)
        if outcome.commit:
            self.guard.clear()  # every rank loaded the complete update: one version again
            return
        what = f"the load was undone on every rank of the replica ({outcome.describe()})"
        if snapshot is None:
            raise LoadFailed(
                f"{what}, but restoring is turned off on rank {vote.rank}: this rank holds "
                f"{'mixed' if own is not None else 'the new'} weights"
            ) from own
        restore_exc = self._restore(snapshot)
        if restore_exc is not None:
            raise LoadFailed(
                f"{what}, but restoring rank {vote.rank}'s previous weights failed "
                f"({type(restore_exc).__name__}: {restore_exc}): the model holds mixed weights"
            ) from (own or restore_exc)
        logger.warning("npu_ipc: %s; rank %d restored its previous weights", what, vote.rank)
        raise LoadRestored(f"{what}; rank {vote.rank} restored its previous weights") from own

    def _restore_unvoted(self, snapshot: Snapshot | None, rank: int, exc: Exception) -> NoReturn:
        """The vote itself failed: restore this rank, and refuse to run (the other ranks' outcome is unknown).

        Raises:
            LoadFailed: Always (`update` trips the guard): this rank may differ from the others.
        """
        state = "restoring is turned off: it holds the new weights"
        if snapshot is not None:
            restore_exc = self._restore(snapshot)
            state = (
                "it restored its previous weights"
                if restore_exc is None
                else f"restoring failed ({type(restore_exc).__name__}: {restore_exc}): it holds mixed weights"
            )
        raise LoadFailed(
            f"the load vote failed ({type(exc).__name__}: {exc}), so the other ranks' outcome is unknown; "
            f"on rank {rank} {state}; send a complete update again"
        ) from exc

    def finish(self) -> None:
        """Close the update; raises if a packed update is missing chunks.

        Raises:
            ProtocolError: A packed update is missing chunks (nothing was loaded).
            LoadFailed: A streamed update is missing chunks after some were loaded (mixed weights).
        """
        self.session.require("finish")
        staged, self._staged = self._staged, None
        streaming, self._streaming = self._streaming, None
        self.session.move(SessionState.READY)
        if streaming is not None and streaming.next_chunk:
            failed = LoadFailed(
                f"finish after {streaming.next_chunk} of {streaming.count} streamed chunks: those were loaded, so "
                "the model holds mixed weights; send a complete update again"
            )
            self.guard.trip(str(failed))
            raise failed
        if staged is not None:
            raise ProtocolError(
                f"finish after {staged.next_chunk} of {staged.plan.num_buffers} chunks: the update was not loaded"
            )

    def shutdown(self) -> None:
        """Forget opened mappings (the runtime's owner closes them); idempotent."""
        self._opened.clear()
        self._staged = self._streaming = None
        self.session.move(SessionState.CLOSED)
