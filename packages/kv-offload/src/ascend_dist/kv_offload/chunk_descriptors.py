"""Copy descriptors between device blocks and host chunks for KV offload.

Runs in: worker processes, once per store or load job. Pure numpy: no torch, no I/O.

A canonical tensor (see `block_views`) has base address ``B``, row stride ``R`` and page width
``W``; device block b sits at ``B + b*R``. Host memory groups ``k = blocks_per_chunk`` device
blocks per host chunk: host rows are ``[num_chunks, W*k]``, so sub-block j of chunk c sits at
``B_h + c*R_h + j*W``. A transfer that starts at a request-relative block index that is not
chunk-aligned enters its first chunk at sub-block ``index mod k`` (the *skip*).

One transfer may span several KV-cache groups; ids of all groups are concatenated, and each group
consumes ``ceil((size + skip) / factor)`` ids from each side (device factor 1, host factor k).
Every data ref of a group gets one descriptor per block of ``ref.copy_bytes`` (the unpadded page,
possibly less than the row stride). Coalescing of ascending or descending runs is optional (the
Ascend code does not coalesce); batches are split to CANN's cap of 4096 descriptors per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import numpy.typing as npt

from ascend_dist.common._address_arrays import AddressTriple
from ascend_dist.common.blocks import BlockIds, validate_block_ids
from ascend_dist.common.errors import BlockIdError, ConfigError, format_allowed

__all__ = [
    "BATCH_COPY_MAX_DESCRIPTORS",
    "ChunkRef",
    "CopyDescriptors",
    "Direction",
    "build_chunk_descriptors",
    "coalesce_descriptors",
    "device_block_addresses",
    "host_chunks_needed",
    "host_subblock_addresses",
    "split_copy_descriptors",
]

# CANN's batched memcpy accepts at most this many descriptors per call.
BATCH_COPY_MAX_DESCRIPTORS = 4096

Direction = Literal["store", "load"]
_DIRECTIONS: tuple[Direction, ...] = ("store", "load")

_I64 = npt.NDArray[np.int64]


def _check_int(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ConfigError(name, value, f"an integer >= {low}")
    return int(value)


@dataclass(frozen=True, eq=False)
class CopyDescriptors(AddressTriple):
    """Parallel arrays of copies: source address, destination address, bytes (``batch_copy`` input).

    Copied into read-only int64 arrays of equal length; offers ``len()``, `total_bytes`, `empty()`,
    `concat(...)`, `slice(start, stop)` and `split(limit)`.

    Raises:
        ConfigError: the arrays differ in length, an address is negative or a size is not positive.
    """

    COLUMNS: ClassVar[tuple[str, str, str]] = ("src", "dst", "sizes")

    src: _I64
    dst: _I64
    sizes: _I64

    def __post_init__(self) -> None:
        self._freeze()


@dataclass(frozen=True)
class ChunkRef:
    """One canonical tensor as both sides of an offload transfer see it.

    Attributes:
        device_base: ``B``, address of device block 0.
        device_row_stride: ``R``, bytes between device blocks.
        row_width: ``W``, the device page width (the canonical view's row bytes).
        copy_bytes: bytes copied per block (``<= row_width``).
        host_base: ``B_h``, address of host chunk 0.
        host_row_stride: ``R_h``, bytes between host chunks; None means ``W * k`` (dense rows).

    Raises:
        ConfigError: a value is negative, a width or stride is not positive, ``copy_bytes`` exceeds
            ``row_width`` or ``device_row_stride`` is below ``row_width``.
    """

    device_base: int
    device_row_stride: int
    row_width: int
    copy_bytes: int
    host_base: int
    host_row_stride: int | None = None

    def __post_init__(self) -> None:
        _check_int("device_base", self.device_base, 0)
        _check_int("host_base", self.host_base, 0)
        _check_int("row_width", self.row_width, 1)
        _check_int("device_row_stride", self.device_row_stride, self.row_width)
        _check_int("copy_bytes", self.copy_bytes, 1)
        if self.copy_bytes > self.row_width:
            raise ConfigError("copy_bytes", self.copy_bytes, f"at most row_width={self.row_width}")
        if self.host_row_stride is not None:
            _check_int("host_row_stride", self.host_row_stride, 1)

    def host_stride(self, blocks_per_chunk: int) -> int:
        """``R_h``: the given host row stride, else the dense ``W * k``.

        Raises:
            ConfigError: the given stride is smaller than a host row ``W * k``.
        """
        dense = self.row_width * blocks_per_chunk
        if self.host_row_stride is None:
            return dense
        return _check_int("host_row_stride", self.host_row_stride, dense)


def host_chunks_needed(num_blocks: int, skip: int, blocks_per_chunk: int) -> int:
    """``ceil((num_blocks + skip) / blocks_per_chunk)``: host chunks touched by a transfer.

    Raises:
        ConfigError: a negative count or skip, a skip ``>= blocks_per_chunk`` or a non-positive k.
    """
    k = _check_int("blocks_per_chunk", blocks_per_chunk, 1)
    skip = _check_int("skip", skip, 0)
    if skip >= k:
        raise ConfigError("skip", skip, f"a sub-block index below blocks_per_chunk={k}")
    return math.ceil((_check_int("num_blocks", num_blocks, 0) + skip) / k)


def device_block_addresses(base: int, row_stride: int, block_ids: BlockIds) -> _I64:
    """``base + b * row_stride`` for every device block b.

    Raises:
        BlockIdError: invalid block ids.
        ConfigError: a negative base or a non-positive stride.
    """
    ids = validate_block_ids(block_ids, field="device_block_ids")
    return _check_int("base", base, 0) + ids * _check_int("row_stride", row_stride, 1)


def host_subblock_addresses(
    base: int,
    row_stride: int,
    row_width: int,
    blocks_per_chunk: int,
    chunk_ids: BlockIds,
    *,
    skip: int = 0,
    count: int | None = None,
) -> _I64:
    """Addresses of the host sub-blocks ``[skip, skip + count)`` of the flattened chunk sequence.

    Sub-block j of chunk c is at ``base + c * row_stride + j * (row_width / blocks_per_chunk)``.

    Args:
        base: ``B_h``, address of host chunk 0.
        row_stride: ``R_h``, bytes between host chunks.
        row_width: ``W_h``, bytes of one host row (``W * k``).
        blocks_per_chunk: ``k``, device blocks per host chunk.
        chunk_ids: the host chunks, in transfer order.
        skip: sub-blocks to skip in the first chunk.
        count: sub-blocks to take; default all after the skip.

    Returns:
        ``count`` addresses.

    Raises:
        BlockIdError: invalid chunk ids, or not exactly ``ceil((count + skip) / k)`` of them.
        ConfigError: bad geometry (``row_width`` not divisible by k, a negative value...).
    """
    chunks = validate_block_ids(chunk_ids, field="host_chunk_ids")
    k = _check_int("blocks_per_chunk", blocks_per_chunk, 1)
    width = _check_int("row_width", row_width, k)
    if width % k:
        raise ConfigError("row_width", width, f"a multiple of blocks_per_chunk={k}")
    stride = _check_int("row_stride", row_stride, width)
    count = chunks.size * k - skip if count is None else count
    needed = host_chunks_needed(count, skip, k)
    if chunks.size != needed:
        raise BlockIdError("host_chunk_ids", f"<{chunks.size} ids>", f"{needed} chunks for {count} blocks")
    one = np.ones(1, dtype=np.int64)
    grid = _host_grid(one * _check_int("base", base, 0), one * stride, one * (width // k), chunks, k)
    return grid[0, skip : skip + count]


def _host_grid(bases: _I64, strides: _I64, sub_strides: _I64, chunks: _I64, k: int) -> _I64:
    """``[ref, chunk * k + j]`` -> ``bases[ref] + chunks[c] * strides[ref] + j * sub_strides[ref]``."""
    sub = np.arange(k, dtype=np.int64)
    grid = (
        bases[:, None, None]
        + chunks[None, :, None] * strides[:, None, None]
        + sub[None, None, :] * sub_strides[:, None, None]
    )
    return grid.reshape(bases.size, chunks.size * k)


def _group_pieces(
    refs: Sequence[ChunkRef], device_ids: _I64, host_ids: _I64, skip: int, k: int
) -> tuple[_I64, _I64, _I64]:
    """Device addresses, host addresses and sizes of one group, ref-major then block order."""
    count = device_ids.size
    geometry = np.array(
        [(r.device_base, r.device_row_stride, r.host_base, r.host_stride(k), r.row_width, r.copy_bytes) for r in refs],
        dtype=np.int64,
    ).T
    dev_base, dev_stride, host_base, host_stride, width, copy = geometry
    dev = dev_base[:, None] + device_ids[None, :] * dev_stride[:, None]
    host = _host_grid(host_base, host_stride, width, host_ids, k)[:, skip : skip + count]
    return dev.reshape(-1), host.reshape(-1), np.repeat(copy, count)


def _groups(
    group_sizes: Sequence[int] | None,
    block_indices: Sequence[int] | None,
    num_device_ids: int,
    num_groups: int,
) -> tuple[list[int], list[int]]:
    """Defaults (one group holding every device id, starting at index 0) and length checks."""
    sizes = [num_device_ids] if group_sizes is None else [_check_int("group_sizes", s, 0) for s in group_sizes]
    starts = [0] * len(sizes) if block_indices is None else [_check_int("block_indices", i, 0) for i in block_indices]
    if len(starts) != len(sizes):
        raise ConfigError("block_indices", list(starts), f"one index per group ({len(sizes)} groups)")
    if num_groups != len(sizes):
        raise ConfigError("refs_per_group", f"<{num_groups} groups>", f"one ref list per group ({len(sizes)})")
    return sizes, starts


def build_chunk_descriptors(
    refs_per_group: Sequence[Sequence[ChunkRef]],
    device_block_ids: BlockIds,
    host_chunk_ids: BlockIds,
    *,
    blocks_per_chunk: int,
    direction: Direction,
    group_sizes: Sequence[int] | None = None,
    block_indices: Sequence[int] | None = None,
    coalesce: bool = False,
    num_host_chunks: int | None = None,
    num_device_blocks: int | None = None,
) -> CopyDescriptors:
    """Build the copies of one offload job.

    Example (store, k=4, one group, refs K and V, page 256 KiB): device blocks ``[11..16]`` with
    ``block_indices=[5]`` skip 1 host sub-block and need host chunks ``[7, 9]``; K gets
    ``B_K + {11..16}*R`` -> ``B_hK + 7 MiB + {1,2,3}*256 KiB`` then ``B_hK + 9 MiB + {0,1,2}*256 KiB``;
    V the same: 12 descriptors, 3 MiB.

    Args:
        refs_per_group: per KV-cache group, its data refs (canonical tensors) in order.
        device_block_ids: device blocks of every group, concatenated in group order.
        host_chunk_ids: host chunks of every group, concatenated in group order.
        blocks_per_chunk: ``k``, device blocks per host chunk.
        direction: ``"store"`` (device -> host) or ``"load"`` (host -> device).
        group_sizes: device blocks per group; default one group with every device id.
        block_indices: request-relative index of each group's first block; default 0s.
        coalesce: merge runs whose source and destination both advance by one copy (see
            `coalesce_descriptors`).
        num_host_chunks: rows of the host allocation; when given, every host id must be below it.
        num_device_blocks: blocks of the device cache; when given, every device id must be below it.

    Returns:
        The copies, group-major, then ref-major, then block order (before coalescing).

    Raises:
        BlockIdError: invalid ids (negative, or past the given allocation: an address outside it would
            be read or written), too few ids for a group, or ids left over after the last group.
        ConfigError: bad direction, group lists of different lengths, or bad geometry.
    """
    if direction not in _DIRECTIONS:
        raise ConfigError("direction", direction, format_allowed(_DIRECTIONS))
    k = _check_int("blocks_per_chunk", blocks_per_chunk, 1)
    device = validate_block_ids(device_block_ids, field="device_block_ids", num_blocks=num_device_blocks)
    host = validate_block_ids(host_chunk_ids, field="host_chunk_ids", num_blocks=num_host_chunks)
    sizes, starts = _groups(group_sizes, block_indices, device.size, len(refs_per_group))
    parts: list[CopyDescriptors] = []
    d_pos = h_pos = 0
    for group, (size, start) in enumerate(zip(sizes, starts, strict=True)):
        if size == 0:
            continue
        skip = start % k
        chunks = host_chunks_needed(size, skip, k)
        if d_pos + size > device.size or h_pos + chunks > host.size:
            have = f"<{device.size - d_pos} device, {host.size - h_pos} host ids left>"
            raise BlockIdError(f"group_sizes[{group}]", have, f"{size} device ids and {chunks} host chunk ids")
        if refs_per_group[group]:
            dev, hst, nbytes = _group_pieces(
                refs_per_group[group], device[d_pos : d_pos + size], host[h_pos : h_pos + chunks], skip, k
            )
            parts.append(
                CopyDescriptors(dev, hst, nbytes) if direction == "store" else CopyDescriptors(hst, dev, nbytes)
            )
        d_pos, h_pos = d_pos + size, h_pos + chunks
    for name, used, total in (("device_block_ids", d_pos, device.size), ("host_chunk_ids", h_pos, host.size)):
        if used != total:
            raise BlockIdError(name, f"<{total} ids>", f"exactly {used} ids, as the groups consume")
    batch = CopyDescriptors.concat(parts)
    return coalesce_descriptors(batch) if coalesce else batch


def coalesce_descriptors(d: CopyDescriptors) -> CopyDescriptors:
    """Merge consecutive copies whose source and destination both advance by exactly one copy.

    Ascending runs (``src[i+1] = src[i] + size``, same for dst) and descending runs (``-size``)
    become one copy of ``run_length * size`` starting at the lower endpoints. Runs are found left to
    right; an element ending one run never starts another. The same bytes go to the same places.

    Args:
        d: the copies, in order.

    Returns:
        The merged copies (the input itself when nothing merges or it has fewer than two).
    """
    n = len(d)
    if n < 2:
        return d
    size = d.sizes[:-1]
    same = d.sizes[1:] == size
    ds, dd = np.diff(d.src), np.diff(d.dst)
    kind = np.where(same & (ds == size) & (dd == size), 1, np.where(same & (ds == -size) & (dd == -size), 2, 0))
    # A link of the other direction right after a kept link would reuse that link's end element:
    # in each chain of consecutive direction changes the 1st, 3rd, ... link is dropped (greedy).
    change = np.zeros(n - 1, dtype=bool)
    change[1:] = (kind[1:] != 0) & (kind[:-1] != 0) & (kind[1:] != kind[:-1])
    pos = np.arange(n - 1)
    chain_start = change & ~np.concatenate(([False], change[:-1]))
    offset = pos - np.maximum.accumulate(np.where(chain_start, pos, 0))
    kept = (kind != 0) & ~(change & (offset % 2 == 0))
    if not kept.any():
        return d
    starts = np.flatnonzero(np.concatenate(([True], ~kept)))
    return CopyDescriptors(
        np.minimum.reduceat(d.src, starts),
        np.minimum.reduceat(d.dst, starts),
        np.add.reduceat(d.sizes, starts),
    )


def split_copy_descriptors(d: CopyDescriptors, limit: int = BATCH_COPY_MAX_DESCRIPTORS) -> list[CopyDescriptors]:
    """Cut a batch into consecutive calls of at most `limit` copies (CANN: 4096), order kept.

    Raises:
        ConfigError: `limit` is not a positive integer.
    """
    return d.split(limit)
