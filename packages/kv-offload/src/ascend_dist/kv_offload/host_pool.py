"""Host chunk pool: which host chunks are free, and the host mirrors of the device views.

Runs in: the scheduler (chunk bookkeeping, pure Python) and worker processes (`allocate_host_mirrors`,
which allocates through the device runtime).

The host tier of every offload path is a set of int8 tensors ``[num_chunks, row_bytes * k]``, one per
canonical device view, where ``k = blocks_per_chunk``. `HostChunkPool` hands out chunk ids: a
request that asks for more than is free gets None, and the caller skips the store with a warning
(the request itself is unaffected). Capacity is computed once (`capacity.py`) and passed to both the
scheduler and the worker, which asserts its allocation holds at least that many chunks.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.kv_offload.chunk_descriptors import ChunkRef

if TYPE_CHECKING:
    import torch

    from ascend_dist.common.device import DeviceRuntime
    from ascend_dist.kv_offload.block_views import BlockView

__all__ = ["HostChunkPool", "HostMirror", "allocate_host_mirrors"]

logger = logging.getLogger(__name__)


class HostChunkPool:
    """Free host chunk ids: a bump allocator, then a FIFO free list of returned ids."""

    def __init__(self, num_chunks: int) -> None:
        """Create a pool of ``num_chunks`` ids ``0..num_chunks-1``.

        Raises:
            ConfigError: ``num_chunks`` is not a positive integer (zero capacity is a config error).
        """
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
            raise ConfigError("num_chunks", num_chunks, "a positive number of host chunks")
        self.num_chunks = num_chunks
        self._next = 0
        self._free: deque[int] = deque()
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        """How many chunks can be allocated now."""
        return self.num_chunks - self._next + len(self._free)

    @property
    def num_used(self) -> int:
        """How many chunks are allocated."""
        return len(self._used)

    def allocate(self, count: int) -> list[int] | None:
        """Take ``count`` chunk ids, or None (nothing taken) when fewer are free.

        Raises:
            ConfigError: ``count`` is negative.
        """
        if count < 0:
            raise ConfigError("count", count, "a non-negative chunk count")
        if count > self.num_free:
            return None
        ids: list[int] = []
        while len(ids) < count and self._free:
            ids.append(self._free.popleft())
        while len(ids) < count:
            ids.append(self._next)
            self._next += 1
        self._used.update(ids)
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Return chunk ids to the pool.

        Raises:
            BlockIdError: an id is not currently allocated (double free or foreign id); nothing is freed.
        """
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise BlockIdError("host_chunk_ids", list(ids), "ids allocated from this pool, each once")
        for i in ids:
            self._used.discard(i)
            self._free.append(i)


@dataclass(frozen=True)
class HostMirror:
    """The host tensors mirroring a list of canonical device views, and the refs to copy between them.

    Attributes:
        tensors: one int8 host tensor ``[num_chunks, row_bytes * blocks_per_chunk]`` per view.
        refs: one `ChunkRef` per view (device geometry + host base), in view order.
        num_chunks: host chunks per tensor.
        blocks_per_chunk: device blocks per host chunk.
    """

    tensors: tuple[torch.Tensor, ...]
    refs: tuple[ChunkRef, ...]
    num_chunks: int
    blocks_per_chunk: int

    @property
    def bytes_per_chunk(self) -> int:
        """Host bytes of one chunk over all tensors."""
        return sum(int(t.shape[1]) for t in self.tensors)


def allocate_host_mirrors(
    runtime: DeviceRuntime, views: Sequence[BlockView], num_chunks: int, blocks_per_chunk: int = 1
) -> HostMirror:
    """Allocate zero-filled (pinned, where the backend pins) host tensors for `views`.

    Args:
        runtime: the device runtime (its ``pinned_empty`` allocates).
        views: canonical device views (see ``ascend_dist.kv_offload.block_views``).
        num_chunks: host chunks per tensor, computed once by the capacity planner.
        blocks_per_chunk: device blocks per host chunk.

    Returns:
        The mirror.

    Raises:
        ConfigError: no views, a non-positive chunk count or factor.
    """
    import torch

    if not views:
        raise ConfigError("views", [], "at least one canonical view to mirror")
    if num_chunks < 1:
        raise ConfigError("num_chunks", num_chunks, "a positive number of host chunks")
    if blocks_per_chunk < 1:
        raise ConfigError("blocks_per_chunk", blocks_per_chunk, "a positive integer")
    tensors: list[torch.Tensor] = []
    refs: list[ChunkRef] = []
    for view in views:
        host = runtime.pinned_empty((num_chunks, view.row_bytes * blocks_per_chunk), torch.int8)
        host.zero_()
        tensors.append(host)
        refs.append(
            ChunkRef(
                device_base=view.base_ptr,
                device_row_stride=view.row_stride,
                row_width=view.row_bytes,
                copy_bytes=view.copy_bytes,
                host_base=host.data_ptr(),
            )
        )
    total = num_chunks * sum(int(t.shape[1]) for t in tensors)
    logger.info("host mirror: %d tensors x %d chunks = %d bytes", len(tensors), num_chunks, total)
    return HostMirror(tuple(tensors), tuple(refs), num_chunks, blocks_per_chunk)
