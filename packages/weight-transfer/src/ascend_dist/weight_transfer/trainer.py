"""Trainer side of the broadcast engine (backend ``hccl``); needs torch, never vLLM.

Runs in: the trainer process (rank 0 of the transfer group). Call order:

    trainer = BroadcastTrainer.connect(...)      # concurrently, every worker runs init(...)
    trainer.send(model.named_parameters())       # concurrently, every worker runs update(...)
    ...
    trainer.shutdown()

`connect` hosts the group's TCPStore on ``master_address:master_port`` and blocks until every
worker joined. `send` runs one update; a worker that dies mid-update makes it raise `WorkerLost`
naming the worker (within the collective's failure time plus about a second of heartbeat probing),
and no worker commits the update.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ascend_dist.common.device.ipc import dtype_to_str
from ascend_dist.common.errors import AscendDistError
from ascend_dist.weight_transfer.broadcast import Phases, send_update
from ascend_dist.weight_transfer.collective import (
    Collective,
    CollectiveFactory,
    TransferGroup,
    gloo_collective,
    lost_ranks,
)
from ascend_dist.weight_transfer.errors import (
    LoadFailed,
    LoadRestored,
    ManifestMismatch,
    ManifestRejected,
    UpdateAborted,
    WorkerLost,
)
from ascend_dist.weight_transfer.messages import (
    DEFAULT_BUFFER_SIZE_BYTES,
    DEFAULT_DIRECT_THRESHOLD_BYTES,
    DEFAULT_NUM_BUFFERS,
    Manifest,
    make_manifest,
)
from ascend_dist.weight_transfer.pool import BufferPool, device_allocator

if TYPE_CHECKING:
    import torch

__all__ = ["BroadcastTrainer", "manifest_of"]

logger = logging.getLogger(__name__)


def manifest_of(
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    packed: bool = True,
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    direct_threshold_bytes: int = 0,
    streamed: bool = False,
) -> Manifest:
    """The manifest of ``(name, tensor)`` pairs (reads names, dtypes and shapes only)."""
    return make_manifest(
        [(name, dtype_to_str(t.dtype), tuple(t.shape)) for name, t in tensors],
        buffer_size_bytes=buffer_size_bytes,
        num_buffers=num_buffers,
        packed=packed,
        direct_threshold_bytes=direct_threshold_bytes,
        streamed=streamed,
    )


class BroadcastTrainer:
    """Sends weight updates to every worker of the transfer group by broadcast from rank 0."""

    def __init__(
        self,
        group: TransferGroup,
        comm: Collective,
        *,
        master_address: str,
        packed: bool = True,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        direct_threshold_bytes: int = DEFAULT_DIRECT_THRESHOLD_BYTES,
        heartbeat_interval_s: float = 0.2,
        streamed: bool = False,
    ) -> None:
        """Wrap an established group; use `connect` to create one."""
        make_manifest(  # validates geometry
            [], buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers, packed=packed, streamed=streamed
        )
        self.group = group
        self.master_address = master_address
        self.packed = packed
        self.buffer_size_bytes = buffer_size_bytes
        self.num_buffers = num_buffers
        self.direct_threshold_bytes = direct_threshold_bytes
        self.streamed = streamed
        self._comm: Collective | None = comm
        self._heartbeat_interval_s = heartbeat_interval_s
        self._broken: str | None = None
        self._next_update_id = 0
        self._pool = BufferPool(device_allocator)  # pipeline / bucket buffers, kept between updates

    @classmethod
    def connect(
        cls,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        device: torch.device | str = "cpu",
        collective_factory: CollectiveFactory = gloo_collective,
        op_timeout_s: float = 300.0,
        packed: bool = True,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        direct_threshold_bytes: int = DEFAULT_DIRECT_THRESHOLD_BYTES,
        streamed: bool = False,
    ) -> BroadcastTrainer:
        """Host the group as rank 0 and wait (up to ``op_timeout_s``) for every worker to join.

        ``streamed``: bounded, pipelined buckets (see `broadcast`); every worker must init with it too.

        Raises:
            ConfigError: Bad world size, timeout or buffer geometry.
            RuntimeError: A worker did not join in time (from the store/collective).
        """
        import torch

        make_manifest(
            [], buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers, packed=packed, streamed=streamed
        )
        group = TransferGroup.join(master_address, master_port, 0, world_size, timeout_s=op_timeout_s)
        comm = collective_factory(group, torch.device(device))
        return cls(
            group, comm, master_address=master_address, packed=packed,
            buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers, direct_threshold_bytes=direct_threshold_bytes,
            streamed=streamed,
        )  # fmt: skip

    @property
    def collective(self) -> Collective | None:
        """The data-plane communicator (None after `shutdown`); for diagnostics and baselines."""
        return self._comm

    def worker_init_info(self, master_port: int, *, op_timeout_s: float | None = None) -> dict[str, Any]:
        """The JSON-safe init payload every worker needs (vLLM ``init_weight_transfer_engine``)."""
        info: dict[str, Any] = {
            "master_address": self.master_address,
            "master_port": master_port,
            "rank_offset": 1,
            "world_size": self.group.world_size,
            "packed": self.packed,
            "packed_buffer_size_bytes": self.buffer_size_bytes,
            "packed_num_buffers": self.num_buffers,
            "packed_direct_threshold_bytes": self.direct_threshold_bytes,
            "op_timeout_s": op_timeout_s if op_timeout_s is not None else self.group.op_timeout_s,
        }
        if self.streamed:  # only then: the payload of a staged trainer stays what it was
            info["streamed"] = True
        return info

    def manifest_of(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Manifest:
        """The manifest of ``tensors`` with this trainer's packing parameters."""
        return manifest_of(
            tensors,
            packed=self.packed,
            buffer_size_bytes=self.buffer_size_bytes,
            num_buffers=self.num_buffers,
            direct_threshold_bytes=self.direct_threshold_bytes,
            streamed=self.streamed,
        )

    def _rejection(self, update_id: int, rank: int) -> str:
        key = f"wt/reject/{update_id}/{rank}"
        store = self.group.store
        return store.get(key).decode() if store.check([key]) else "(no reason published)"

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest | None = None) -> Phases:
        """Send one update to every worker (each must call its ``update`` concurrently).

        Args:
            tensors: ``(name, tensor)`` pairs in send order. Without ``manifest`` they are listed
                first to build one; with it, they are consumed lazily and checked against it.
            manifest: The update's manifest (from `manifest_of` or the source's metadata).

        Returns:
            The trainer-side time split.

        Raises:
            ManifestMismatch: A worker refused the update (its reason is quoted); nothing changed.
            WorkerLost: Workers stopped responding; they are named; no worker committed.
            UpdateAborted: The collective failed with every worker alive; no worker committed.
            LoadRestored: A worker's loader failed after the commit vote; every worker restored its
                previous weights (the failing ranks are named); the group is usable.
            LoadFailed: The same, but the named workers could not restore: mixed weights there.
        """
        comm = self._comm
        if comm is None or self._broken is not None:
            raise UpdateAborted(f"the transfer group is unusable ({self._broken or 'shut down'}); connect again")
        if manifest is None:
            tensors = list(tensors)
            manifest = self.manifest_of(tensors)
        update_id = self._next_update_id
        self._next_update_id += 1
        try:
            return send_update(
                comm, manifest, tensors, update_id=update_id, rejection_detail=self._rejection, pool=self._pool
            )
        except (ManifestRejected, LoadFailed, LoadRestored):
            raise  # refused at the vote, or a worker's loader failed (restored or not): the group is intact
        except (AscendDistError, RuntimeError) as exc:
            # The HCCL path fails with typed errors (CollectiveError, DeadlineExceeded) and gloo with
            # RuntimeError: either way a dead worker is the likely cause, so ask the heartbeats first.
            typed = isinstance(exc, AscendDistError)
            self._broken = (f"{type(exc).__name__}: {exc}" if typed else str(exc).splitlines()[0])[:200]
            lost = () if isinstance(exc, ManifestMismatch) else self._lost_workers()
            outcome = (
                "workers that loaded buckets of this streamed update hold mixed weights (PartialUpdate)"
                if manifest.streamed
                else "no worker committed the update"
            )
            if lost:
                raise WorkerLost(
                    f"update {update_id}: worker ranks {list(lost)} stopped responding ({self._broken}); {outcome}",
                    ranks=lost,
                ) from exc
            if typed:
                raise
            raise UpdateAborted(f"update {update_id} failed: {self._broken}; {outcome}") from exc

    def _lost_workers(self) -> tuple[int, ...]:
        try:
            return lost_ranks(self.group.store, range(1, self.group.world_size), interval_s=self._heartbeat_interval_s)
        except (RuntimeError, OSError) as exc:  # the store itself failed: report the transfer's error, not this
            logger.warning("heartbeat check after a failed update failed: %s", exc)
            return ()

    def shutdown(self) -> None:
        """Destroy the communicator and free the pipeline buffers; idempotent.

        The store closes when the trainer drops it.
        """
        self._pool.clear()
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()
