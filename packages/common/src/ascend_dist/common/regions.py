"""Memory regions handed to a transfer engine for registration.

Runs in: worker processes, once at KV-cache registration.

HCCL allows at most 256 registered regions per process, while a model has hundreds of KV tensors.
Tensors that share one allocation (one torch storage) are therefore merged into as few byte ranges
as possible: ranges of the same storage closer than `MERGE_GAP_BYTES` are bridged. Ranges of
different storages are never merged, even when adjacent, because a region must lie inside one
allocation. Handshake metadata keeps per-tensor addresses; only registration uses merged ranges.

torch is imported lazily, only by the functions that look at tensors.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ascend_dist.common.errors import RegionError

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_REGISTERED_REGIONS",
    "MERGE_GAP_BYTES",
    "RegionLimitError",
    "RegisterRange",
    "RegisterRegions",
    "collect_storage_merged_register_regions",
    "iter_kv_cache_tensors",
    "merge_ranges",
    "tensor_storage_key",
    "validate_ranges",
    "validate_register_region_count",
]

logger = logging.getLogger(__name__)

# Ranges of one storage separated by at most this many bytes are registered as one region.
MERGE_GAP_BYTES = 4096
# HCCL's per-process limit on registered memory regions.
MAX_REGISTERED_REGIONS = 256


class RegionLimitError(RegionError, RuntimeError):
    """More memory regions than the engine accepts; nothing was registered.

    Upstream raises RuntimeError here, so this is both a `RegionError` (a `ValueError`) and a
    `RuntimeError`: either ``except`` keeps working. Reduce KV-cache fragmentation (fewer, larger
    allocations) and restart; there is no way to degrade at run time.
    """


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, order=True)
class RegisterRange:
    """A half-open byte range ``[start, end)`` of process memory.

    Raises:
        RegionError: unless ``end > start >= 0`` (both integers).
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (_is_int(self.start) and _is_int(self.end)) or self.start < 0:
            raise RegionError("start", self.start, "a non-negative integer address")
        if self.end <= self.start:
            raise RegionError("end", self.end, f"an integer address above start={self.start:#x}")

    @property
    def length(self) -> int:
        """Number of bytes in the range."""
        return self.end - self.start

    def __repr__(self) -> str:
        return f"RegisterRange({self.start:#x}, {self.end:#x})"


@dataclass(frozen=True)
class RegisterRegions:
    """The regions to register: parallel tuples of start addresses and lengths.

    `logical_tensor_count` and `logical_total_bytes` describe the tensors the regions were built
    from (for error messages); they are None when unknown.

    Raises:
        RegionError: the tuples differ in length, a pointer is negative or a length is not positive.
    """

    ptrs: tuple[int, ...]
    lengths: tuple[int, ...]
    logical_tensor_count: int | None = None
    logical_total_bytes: int | None = None

    def __post_init__(self) -> None:
        if len(self.ptrs) != len(self.lengths):
            raise RegionError("lengths", f"<{len(self.lengths)} lengths>", f"one length per pointer ({len(self.ptrs)})")
        for index, (ptr, length) in enumerate(zip(self.ptrs, self.lengths, strict=True)):
            if not _is_int(ptr) or ptr < 0:
                raise RegionError(f"ptrs[{index}]", ptr, "a non-negative integer address")
            if not _is_int(length) or length <= 0:
                raise RegionError(f"lengths[{index}]", length, "a positive number of bytes")

    def __len__(self) -> int:
        return len(self.ptrs)

    @property
    def registered_bytes(self) -> int:
        """Total bytes over all regions."""
        return sum(self.lengths)

    def ranges(self) -> list[RegisterRange]:
        """The regions as `RegisterRange` objects, in order."""
        return [RegisterRange(p, p + n) for p, n in zip(self.ptrs, self.lengths, strict=True)]


def merge_ranges(ranges: Iterable[RegisterRange], *, gap: int = MERGE_GAP_BYTES) -> list[RegisterRange]:
    """Sort ranges and merge those that overlap, touch, or are at most `gap` bytes apart.

    A range is merged into the current one when ``next.start <= current.end + gap``; the merged
    end is the larger of the two ends. With ``gap=0`` the result covers exactly the input bytes.

    Args:
        ranges: byte ranges in any order; overlaps are allowed.
        gap: the largest hole (bytes) that is bridged.

    Returns:
        Sorted, disjoint ranges separated by more than `gap` bytes.

    Raises:
        RegionError: `gap` is negative or not an integer.
    """
    if not _is_int(gap) or gap < 0:
        raise RegionError("gap", gap, "a non-negative number of bytes")
    ordered = sorted(ranges, key=lambda r: (r.start, r.end))
    merged: list[RegisterRange] = []
    if not ordered:
        return merged
    start, end = ordered[0].start, ordered[0].end
    for item in ordered[1:]:
        if item.start <= end + gap:
            end = max(end, item.end)
        else:
            merged.append(RegisterRange(start, end))
            start, end = item.start, item.end
    merged.append(RegisterRange(start, end))
    return merged


def validate_ranges(ranges: Sequence[RegisterRange], *, field: str = "regions") -> None:
    """Strict check: ranges must be sorted by address and must not overlap (touching is fine).

    For callers that must not pass overlapping or out-of-order ranges (no silent merging).

    Args:
        ranges: the ranges in the order the caller will register them.
        field: the name used in error messages.

    Raises:
        RegionError: an element is not a `RegisterRange`, or a pair is out of order or overlaps; the
            message names the first offending pair (``regions[i]`` and ``regions[i+1]``).
    """
    for index, item in enumerate(ranges):
        if not isinstance(item, RegisterRange):
            raise RegionError(f"{field}[{index}]", item, "a RegisterRange")
    for index in range(len(ranges) - 1):
        prev, nxt = ranges[index], ranges[index + 1]
        if nxt.start < prev.start:
            problem = "out of order"
        elif nxt.start < prev.end:
            problem = "overlapping"
        else:
            continue
        raise RegionError(
            f"{field}[{index + 1}]",
            nxt,
            f"a range starting at or after the end of {field}[{index}]={prev!r} ({problem} pair)",
        )


def iter_kv_cache_tensors(obj: object) -> Iterator[torch.Tensor]:
    """Yield the tensors nested in `obj`, depth first.

    Dicts contribute their values, lists and tuples their items, a tensor itself; None yields
    nothing.

    Args:
        obj: a tensor or a nest of dicts, lists and tuples of tensors (vLLM's ``kv_caches``).

    Yields:
        Each tensor in depth-first order (duplicates included).

    Raises:
        RegionError: a leaf is neither a tensor nor None.
    """
    import torch

    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_kv_cache_tensors(value)
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from iter_kv_cache_tensors(value)
    else:
        raise RegionError("kv_caches", type(obj).__name__, "tensors nested in dicts, lists and tuples")


def tensor_storage_key(t: torch.Tensor) -> int:
    """A key that is equal for tensors sharing one allocation: the storage's base pointer.

    Only a grouping key, never an address to register (an aligned view may start after an
    unaligned storage base). Falls back to the legacy typed storage, then to the data pointer.

    Args:
        t: any tensor.

    Returns:
        The storage base address as an int.
    """
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, AttributeError, NotImplementedError):
        pass
    try:
        with warnings.catch_warnings():
            # The legacy accessor warns that TypedStorage is deprecated; it is only a fallback.
            warnings.simplefilter("ignore")
            return int(t.storage().data_ptr())
    except (RuntimeError, AttributeError, NotImplementedError):
        return int(t.data_ptr())


def collect_storage_merged_register_regions(kv_caches: object) -> RegisterRegions:
    """Compute the regions to register for a nest of KV-cache tensors, merged per storage.

    Every non-empty tensor contributes ``[data_ptr, data_ptr + nbytes)``; a non-contiguous tensor
    (a strided view, e.g. one layer of a block-outermost KV cache, whose blocks lie further apart
    than its logical bytes) contributes the bytes it spans, from its first to its last addressed
    byte, and is logged at WARNING. Ranges are grouped by storage (in
    first-seen order), sorted and merged with `merge_ranges` (gap `MERGE_GAP_BYTES`). Ranges of
    different storages are never merged.

    Args:
        kv_caches: tensors nested in dicts, lists and tuples (see `iter_kv_cache_tensors`).

    Returns:
        The merged regions, with the logical tensor count and byte total of the input.

    Raises:
        RegionError: the nest holds something other than tensors.
    """
    per_storage: dict[int, list[RegisterRange]] = {}
    count = 0
    total = 0
    for tensor in iter_kv_cache_tensors(kv_caches):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            continue
        span = nbytes
        if not tensor.is_contiguous():
            last = sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride(), strict=True))
            span = max(nbytes, (last + 1) * tensor.element_size())
            logger.warning(
                "KV-cache tensor shape=%s stride=%s is not contiguous; registering the %d bytes it spans",
                tuple(tensor.shape),
                tuple(tensor.stride()),
                span,
            )
        start = tensor.data_ptr()
        per_storage.setdefault(tensor_storage_key(tensor), []).append(RegisterRange(start, start + span))
        count += 1
        total += nbytes
    merged = [region for ranges in per_storage.values() for region in merge_ranges(ranges)]
    return RegisterRegions(
        ptrs=tuple(r.start for r in merged),
        lengths=tuple(r.length for r in merged),
        logical_tensor_count=count,
        logical_total_bytes=total,
    )


def validate_register_region_count(regions: RegisterRegions, *, limit: int = MAX_REGISTERED_REGIONS) -> None:
    """Refuse to register more regions than the engine accepts.

    Args:
        regions: the regions about to be registered.
        limit: the largest accepted count (HCCL: 256 per process).

    Raises:
        RegionLimitError: more than `limit` regions; the message gives the registered bytes, the
            logical tensor count and bytes when known, and how to reduce fragmentation.
        RegionError: `limit` is not a positive integer.
    """
    if not _is_int(limit) or limit <= 0:
        raise RegionError("limit", limit, "a positive integer")
    if len(regions) <= limit:
        return
    logical = ""
    if regions.logical_tensor_count is not None:
        logical = f" from {regions.logical_tensor_count} tensors"
        if regions.logical_total_bytes is not None:
            logical += f" ({regions.logical_total_bytes} logical bytes)"
    raise RegionLimitError(
        "regions",
        len(regions),
        f"at most {limit} registered regions (the per-process registration limit); "
        f"got {len(regions)} regions covering {regions.registered_bytes} registered bytes{logical}. "
        "Reduce fragmentation: allocate KV caches in fewer, larger storages so neighbouring tensors merge",
    )
