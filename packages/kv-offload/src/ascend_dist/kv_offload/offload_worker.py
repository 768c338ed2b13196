"""The offload worker: host mirrors of the canonical KV views and one handler per direction.

Runs in: worker processes (native offloading's worker, recompute connector's worker, the demo).

`OffloadWorker` is what vLLM's ``OffloadingWorker`` contract asks for (``submit_store``,
``submit_load``, ``get_finished``, ``wait``, ``shutdown``) in our own types: device block ids and
host chunk ids as integer sequences. It allocates, per unique canonical view, one host tensor of
``num_chunks`` rows of ``row_bytes * blocks_per_chunk`` bytes (the capacity computed once by
`capacity.py`), and two `DirectionHandler` objects sharing those tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ascend_dist.common.blocks import BlockIds
from ascend_dist.common.device import DeviceRuntime
from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_offload.block_views import BlockView
from ascend_dist.kv_offload.chunk_descriptors import ChunkRef
from ascend_dist.kv_offload.host_pool import HostMirror, allocate_host_mirrors
from ascend_dist.kv_offload.transfer import DEFAULT_WAIT_S, DirectionHandler, TransferResult

__all__ = ["GroupRef", "OffloadWorker"]


@dataclass(frozen=True)
class GroupRef:
    """One layer-part of a KV-cache group: which unique view, and the bytes copied per block.

    Attributes:
        view_index: index into the worker's unique views.
        copy_bytes: unpadded bytes of this part per block (``<=`` the view's row bytes).
    """

    view_index: int
    copy_bytes: int


class OffloadWorker:
    """Stores (device -> host) and loads (host -> device) of whole jobs, reported in order per direction."""

    def __init__(
        self,
        runtime: DeviceRuntime,
        views: Sequence[BlockView],
        group_refs: Sequence[Sequence[GroupRef]] | None = None,
        *,
        num_chunks: int,
        blocks_per_chunk: int = 1,
        coalesce: bool = True,
    ) -> None:
        """Allocate the host mirror and create both handlers.

        Args:
            runtime: the device runtime.
            views: unique canonical views (int8, 2-D; see ``ascend_dist.kv_offload.block_views``).
            group_refs: per KV-cache group, its parts; default one group over every view with the
                view's own ``copy_bytes``.
            num_chunks: host chunks per tensor (computed once by the capacity planner).
            blocks_per_chunk: device blocks per host chunk.
            coalesce: merge adjacent runs into one descriptor.

        Raises:
            ConfigError: a view that is not int8 2-D, a ref to an unknown view or copying more than
                a row, zero capacity.
        """
        import torch

        for i, view in enumerate(views):
            if view.tensor.dtype != torch.int8 or view.tensor.dim() != 2:
                raise ConfigError(f"views[{i}]", f"{view.tensor.dtype} {tuple(view.tensor.shape)}", "an int8 2-D view")
        if group_refs is None:
            group_refs = [[GroupRef(i, v.copy_bytes) for i, v in enumerate(views)]]
        self.mirror: HostMirror = allocate_host_mirrors(runtime, views, num_chunks, blocks_per_chunk)
        refs_per_group = [[self._chunk_ref(views, r) for r in group] for group in group_refs]
        self.blocks_per_chunk = blocks_per_chunk
        # Ids are checked against both allocations: an id past either addresses someone else's memory.
        bounds = {
            "num_host_chunks": self.mirror.num_chunks,
            "num_device_blocks": min((int(v.tensor.shape[0]) for v in views), default=None),
        }
        self.store = DirectionHandler(
            runtime, refs_per_group, direction="store", blocks_per_chunk=blocks_per_chunk, coalesce=coalesce, **bounds
        )
        self.load = DirectionHandler(
            runtime, refs_per_group, direction="load", blocks_per_chunk=blocks_per_chunk, coalesce=coalesce, **bounds
        )

    def _chunk_ref(self, views: Sequence[BlockView], ref: GroupRef) -> ChunkRef:
        if not 0 <= ref.view_index < len(views):
            raise ConfigError("group_refs.view_index", ref.view_index, f"an index below {len(views)}")
        base = self.mirror.refs[ref.view_index]
        if ref.copy_bytes > base.row_width:
            raise ConfigError("group_refs.copy_bytes", ref.copy_bytes, f"at most the row width {base.row_width}")
        return ChunkRef(base.device_base, base.device_row_stride, base.row_width, ref.copy_bytes, base.host_base)

    def submit_store(
        self,
        job_id: int,
        device_block_ids: BlockIds,
        host_chunk_ids: BlockIds,
        *,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> bool:
        """Device -> host, after the current (compute) stream's work so far (see `DirectionHandler`)."""
        return self.store.transfer_async(
            job_id, device_block_ids, host_chunk_ids, group_sizes=group_sizes, block_indices=block_indices
        )

    def submit_load(
        self,
        job_id: int,
        host_chunk_ids: BlockIds,
        device_block_ids: BlockIds,
        *,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> bool:
        """Host -> device."""
        return self.load.transfer_async(
            job_id, device_block_ids, host_chunk_ids, group_sizes=group_sizes, block_indices=block_indices
        )

    def get_finished(self) -> list[TransferResult]:
        """Completed stores then completed loads, each in submission order."""
        return self.store.get_finished() + self.load.get_finished()

    def wait(self, job_ids: Iterable[int], timeout: float = DEFAULT_WAIT_S) -> None:
        """Wait for the given jobs in both directions (unknown ids ignored)."""
        ids = list(job_ids)
        self.store.wait(ids, timeout)
        self.load.wait(ids, timeout)

    def shutdown(self, timeout: float = DEFAULT_WAIT_S) -> list[TransferResult]:
        """Drain both directions and return what finished meanwhile; idempotent."""
        return self.store.shutdown(timeout) + self.load.shutdown(timeout)
