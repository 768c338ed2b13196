"""Worker side of the broadcast engine (backend ``hccl``), without vLLM.

Runs in: each inference worker process. Call order (driven by vLLM's worker or by hand):

    init(...)  ->  start()  ->  update(names, dtype_names, shapes) [one or more]  ->  finish()
    ... start() again for the next update ...   shutdown()

`init` joins the trainer's transfer group (blocking until the trainer and every worker joined);
the worker's rank in it is `worker_group_rank`. An update is received into staging tensors and
loaded into the model only when every rank has every byte, so a failed update leaves the previous
weights in place (`init(streamed=True)`: bounded buckets loaded as they land instead, see
`broadcast`). After a failed collective the group is unusable: `update` then raises
`UpdateAborted` until `init` is called again.

When an update leaves mixed weights (a streamed `PartialUpdate` or `LoadFailed`, a staged update
some rank could not restore) the worker trips its `guard`: installed on the model, it makes every
forward raise `WeightsInconsistent` until a later update succeeds on this worker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ascend_dist.common.errors import AscendDistError, ConfigError
from ascend_dist.weight_transfer.broadcast import Phases, receive_update
from ascend_dist.weight_transfer.collective import (
    Collective,
    CollectiveFactory,
    Heartbeat,
    TransferGroup,
    gloo_collective,
)
from ascend_dist.weight_transfer.errors import (
    LoadFailed,
    LoadRestored,
    ManifestRejected,
    PartialUpdate,
    UpdateAborted,
)
from ascend_dist.weight_transfer.guard import WeightsGuard
from ascend_dist.weight_transfer.messages import (
    DEFAULT_BUFFER_SIZE_BYTES,
    DEFAULT_DIRECT_THRESHOLD_BYTES,
    DEFAULT_NUM_BUFFERS,
    Manifest,
    make_manifest,
)
from ascend_dist.weight_transfer.pool import BufferPool, device_allocator
from ascend_dist.weight_transfer.session import Session, SessionState, WeightSink

if TYPE_CHECKING:
    import torch

__all__ = ["BroadcastWorker", "Stoppable", "worker_group_rank"]

logger = logging.getLogger(__name__)


class Stoppable(Protocol):
    """A worker's liveness publisher (`Heartbeat`): `stop` joins its thread or raises."""

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop publishing; raises `DeadlineExceeded` when its thread does not end."""
        ...


def worker_group_rank(rank_offset: int, data_parallel_index: int, replica_world_size: int, rank_in_replica: int) -> int:
    """A worker's rank in the trainer-to-workers group (the trainer holds ranks below ``rank_offset``).

    ``rank_offset + data_parallel_index * replica_world_size + rank_in_replica``, where
    ``replica_world_size`` is TP x PP x PCP of one DP replica and ``rank_in_replica`` the worker's
    rank inside it (vLLM ``ParallelConfig.world_size`` and ``.rank``).

    Raises:
        ConfigError: A negative index, a rank outside its replica, or a non-positive size.
    """
    if replica_world_size <= 0:
        raise ConfigError("replica_world_size", replica_world_size, "a positive integer")
    if not 0 <= rank_in_replica < replica_world_size:
        raise ConfigError("rank_in_replica", rank_in_replica, f"0..{replica_world_size - 1}")
    if data_parallel_index < 0:
        raise ConfigError("data_parallel_index", data_parallel_index, "a non-negative integer")
    if rank_offset < 1:
        raise ConfigError("rank_offset", rank_offset, "at least 1 (the trainer is rank 0)")
    return rank_offset + data_parallel_index * replica_world_size + rank_in_replica


class BroadcastWorker:
    """Receives packed or per-tensor broadcasts from the trainer and loads them into a model."""

    def __init__(
        self,
        sink: WeightSink,
        *,
        device: torch.device | str = "cpu",
        collective_factory: CollectiveFactory = gloo_collective,
        validate: Callable[[Manifest], None] | None = None,
        heartbeat_interval_s: float = 0.2,
        heartbeat_factory: Callable[[Any, int, float], Stoppable] = Heartbeat,
        guard: WeightsGuard | None = None,
    ) -> None:
        """Create an engine that is not yet in a group.

        Args:
            sink: Where received weights are loaded (a vLLM model or a `ModuleSink`).
            device: Device of the receive buffers and staging tensors.
            collective_factory: Builds the data plane (`gloo_collective` on CPU, `hccl_collective`).
            validate: Optional check of each manifest against the model before any byte is received.
            heartbeat_interval_s: Liveness interval published to the trainer.
            heartbeat_factory: Starts the liveness publisher ``(store, rank, interval_s)``.
            guard: Tripped while the model may hold mixed weights (install it on the model); a
                fresh one by default.
        """
        import torch

        self.sink = sink
        self.device = torch.device(device)
        self._factory = collective_factory
        self._validate = validate
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_factory = heartbeat_factory
        self.guard = guard if guard is not None else WeightsGuard()
        self.session = Session("hccl weight transfer")
        self._group: TransferGroup | None = None
        self._comm: Collective | None = None
        self._heartbeat: Stoppable | None = None
        self._broken: str | None = None
        self.packed = True
        self.buffer_size_bytes = DEFAULT_BUFFER_SIZE_BYTES
        self.num_buffers = DEFAULT_NUM_BUFFERS
        self.direct_threshold_bytes = DEFAULT_DIRECT_THRESHOLD_BYTES
        self.streamed = False
        self.last_update_id = -1
        self.last_phases: Phases | None = None
        self._pool = BufferPool(device_allocator)  # the staging stream, kept between updates

    @property
    def rank(self) -> int | None:
        """This worker's rank in the transfer group (None before `init`)."""
        return None if self._group is None else self._group.rank

    @property
    def collective(self) -> Collective | None:
        """The data-plane communicator (None before `init`); for diagnostics and baselines."""
        return self._comm

    def init(
        self,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        packed: bool = True,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        op_timeout_s: float = 300.0,
        direct_threshold_bytes: int = DEFAULT_DIRECT_THRESHOLD_BYTES,
        streamed: bool = False,
    ) -> None:
        """Join the trainer's group (collective with the trainer and every other worker).

        ``streamed``: updates travel in buckets of whole tensors of at most ``buffer_size_bytes``,
        loaded as each lands; at most ``num_buffers`` buffers exist (kept between updates, freed by
        `shutdown` and a new `init`). A failure mid-update then leaves mixed weights
        (`PartialUpdate` / `LoadFailed`), not the old ones.

        Raises:
            UpdateStateError: Called while an update is active or after shutdown.
            ConfigError: Bad rank, world size, buffer geometry or timeout.
        """
        self.session.require("init")
        make_manifest(  # validates the geometry
            [],
            buffer_size_bytes=buffer_size_bytes,
            num_buffers=num_buffers,
            direct_threshold_bytes=direct_threshold_bytes,
            streamed=streamed,
            packed=packed,
        )
        self._release()
        group = TransferGroup.join(master_address, master_port, rank, world_size, timeout_s=op_timeout_s)
        self._heartbeat = self._heartbeat_factory(group.store, rank, self._heartbeat_interval_s)
        self._group = group
        self._comm = self._factory(group, self.device)
        self._broken = None
        self.packed, self.buffer_size_bytes, self.num_buffers = packed, buffer_size_bytes, num_buffers
        self.direct_threshold_bytes = direct_threshold_bytes
        self.streamed = streamed
        self.session.move(SessionState.READY)
        logger.info("weight transfer worker rank=%d world=%d packed=%s", rank, world_size, packed)

    def start(self) -> None:
        """Open an update (raises `UpdateStateError` if one is already open)."""
        self.session.require("start")
        self.session.move(SessionState.ACTIVE)

    def update(self, names: list[str], dtype_names: list[str], shapes: list[list[int]], *, refuse: str = "") -> Phases:
        """Receive one update described by vLLM-style metadata, then load it into the sink.

        Args:
            names: Tensor names in the trainer's send order.
            dtype_names: Their dtype names (``"bfloat16"``).
            shapes: Their shapes.
            refuse: A reason to refuse this update (the worker still joins the manifest exchange
                and votes no, so the trainer fails fast with the reason instead of timing out).

        Raises:
            UpdateStateError: No update is active.
            ManifestRejected: The trainer sends something else, or the metadata is malformed (lists
                of different lengths, an unknown dtype); the difference is named; nothing changed.
            UpdateAborted: The update did not complete on every rank; the model keeps its weights.
            LoadRestored: A rank's loader failed after every rank committed; every rank restored its
                previous weights (this rank's loader error, if any, is the cause).
            LoadFailed: The same, but some rank could not restore (no restore point, or the copy
                back failed): mixed weights; streamed: any rank's loader failed.
            PartialUpdate: Streamed: the collective failed after buckets were loaded.
        """
        self.session.require("update")
        try:
            expected, why = self._expected(names, dtype_names, shapes)
            return self._receive(None if refuse else expected, refuse or why)
        except BaseException:
            self.session.move(SessionState.READY)  # the caller can start over
            raise

    def _expected(
        self, names: list[str], dtype_names: list[str], shapes: list[list[int]]
    ) -> tuple[Manifest | None, str]:
        """This worker's manifest, or None and the reason it cannot build one (it then votes no)."""
        if not len(names) == len(dtype_names) == len(shapes):
            return (
                None,
                f"update_info lists differ: {len(names)} names, {len(dtype_names)} dtypes, {len(shapes)} shapes",
            )
        try:
            manifest = make_manifest(
                list(zip(names, dtype_names, [tuple(s) for s in shapes], strict=True)),
                buffer_size_bytes=self.buffer_size_bytes,
                num_buffers=self.num_buffers,
                packed=self.packed,
                direct_threshold_bytes=self.direct_threshold_bytes,
                streamed=self.streamed,
            )
        except ConfigError as exc:
            return None, f"bad update_info: {exc}"
        return manifest, ""

    def _receive(self, expected: Manifest | None, refuse: str) -> Phases:
        comm, group = self._comm, self._group
        assert comm is not None and group is not None
        if self._broken is not None:
            raise UpdateAborted(f"the transfer group failed earlier ({self._broken}); call init again")

        def reject(update_id: int, reason: str) -> None:
            group.store.set(f"wt/reject/{update_id}/{group.rank}", reason)

        try:
            update_id, phases = receive_update(
                comm, expected, self.sink, reject=reject, refuse=refuse, validate=self._validate, pool=self._pool
            )
        except PartialUpdate as exc:  # the wire broke after loads began: mixed weights, group unusable
            self._broken = f"{type(exc).__name__}: {exc}"[:200]
            self.guard.trip(f"{type(exc).__name__}: {exc}")
            raise
        except LoadFailed as exc:  # a loader failed and the ranks could not all be put back: mixed weights
            self.guard.trip(f"{type(exc).__name__}: {exc}")
            raise
        except (ManifestRejected, LoadRestored):
            raise  # refused at the vote, or the model's loader failed after it and every rank restored
        except UpdateAborted as exc:
            self._broken = f"{type(exc).__name__}: {exc}"[:200]
            raise
        except (AscendDistError, RuntimeError) as exc:  # the collective failed: the group is unusable from now on
            # gloo raises RuntimeError, the HCCL path CollectiveError / DeadlineExceeded: one typed outcome
            self._broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
            raise UpdateAborted(f"weight update aborted on worker rank {group.rank}: {self._broken}") from exc
        self.last_update_id, self.last_phases = update_id, phases
        self.guard.clear()  # a complete update loaded on every rank: one version again
        return phases

    def finish(self) -> None:
        """Close the update (raises `UpdateStateError` if none is open)."""
        self.session.require("finish")
        self.session.move(SessionState.READY)

    def _release(self) -> None:
        self._pool.clear()
        heartbeat, self._heartbeat = self._heartbeat, None
        comm, self._comm = self._comm, None
        self._group = None
        try:
            if heartbeat is not None:
                heartbeat.stop()
        finally:  # a heartbeat that would not stop must not leak the communicator
            if comm is not None:
                comm.destroy()

    def shutdown(self) -> None:
        """Stop the heartbeat, destroy the communicator, leave the group; idempotent."""
        self._release()
        self.session.move(SessionState.CLOSED)
