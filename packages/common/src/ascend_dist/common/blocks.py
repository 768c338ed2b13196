"""Block-id validation and run detection, vectorised with numpy.

Runs in: any process (scheduler or worker). Pure: no I/O, no torch.

Block ids arrive as Python lists from vLLM or as numpy arrays from planning code. Everything here works
on whole arrays at once, because a request can carry thousands of blocks and descriptor building
runs once per request per peer: a Python loop per id would dominate the transfer set-up time.

A *run* is a maximal stretch of ids that advance by exactly one (``[4, 5, 6]``); a *paired run*
needs the ids on both sides (remote and local) to advance together, so one descriptor can move the
whole stretch. `group_concurrent_contiguous` is the generalisation with byte strides used by the P2P
connector.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from ascend_dist.common.errors import BlockIdError, ConfigError

__all__ = [
    "BlockIds",
    "contiguous_runs",
    "group_concurrent_contiguous",
    "paired_runs",
    "validate_block_ids",
]

# What callers may pass as block ids: a list from vLLM, a range, or an integer numpy array.
BlockIds: TypeAlias = Sequence[int] | npt.NDArray[np.integer] | Iterable[int]

_INT64_MAX = np.iinfo(np.int64).max


def _first_bad(mask: npt.NDArray[np.bool_]) -> int | None:
    """Return the first True position of `mask`, or None when every entry is fine."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _bad_id(field: str, position: int, value: object, expected: str) -> BlockIdError:
    return BlockIdError(f"{field}[{position}]", value, expected)


def _object_to_int64(arr: npt.NDArray[np.object_], field: str) -> npt.NDArray[np.int64]:
    """Convert a mixed-type array; only reached for unusual inputs, so a scan is acceptable here."""
    for position, value in enumerate(arr.tolist()):
        if isinstance(value, bool) or not isinstance(value, int | np.integer):
            raise _bad_id(field, position, value, "an integer block id")
    try:
        return arr.astype(np.int64)
    except OverflowError as exc:
        raise BlockIdError(field, "<out of int64 range>", "block ids that fit in int64") from exc


def _float_to_int64(arr: npt.NDArray[np.floating], field: str) -> npt.NDArray[np.int64]:
    """Accept integral floats (``2.0``), reject fractions, NaN and infinities."""
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(arr) | (arr != np.floor(arr)) | (np.abs(arr) > _INT64_MAX)
    position = _first_bad(bad)
    if position is not None:
        raise _bad_id(field, position, arr[position].item(), "an integer block id")
    return arr.astype(np.int64)


def _as_array(ids: object, field: str) -> tuple[np.ndarray, list[object] | None]:
    """`ids` as a 1-D numpy array, plus the caller's items when they were not an array already."""
    if isinstance(ids, np.ndarray):
        arr, items = ids, None
    elif isinstance(ids, Iterable) and not isinstance(ids, str | bytes):
        items = list(ids)
        try:
            arr = np.asarray(items)
        except ValueError as exc:  # ragged nesting
            raise BlockIdError(field, "<ragged sequence>", "a 1-D sequence of integer block ids") from exc
    else:
        raise BlockIdError(field, type(ids).__name__, "a sequence of integer block ids")
    if arr.ndim != 1:
        raise BlockIdError(field, f"<array of shape {arr.shape}>", "a 1-D sequence of integer block ids")
    return arr, items


def _coerce_int64(ids: object, field: str) -> npt.NDArray[np.int64]:
    """Turn `ids` into a 1-D int64 array or raise `BlockIdError` naming `field`."""
    arr, items = _as_array(ids, field)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    kind = arr.dtype.kind
    if kind == "i":
        return arr.astype(np.int64, copy=False)
    if kind == "u":
        position = _first_bad(arr > _INT64_MAX)
        if position is not None:
            raise _bad_id(field, position, arr[position].item(), "a block id that fits in int64")
        return arr.astype(np.int64)
    if kind == "f":
        return _float_to_int64(arr, field)
    # Objects, booleans, strings: check item by item. Use the caller's items, since numpy turns
    # every item of a mixed list such as [1, "x"] into a string.
    boxed = np.empty(arr.size, dtype=object)
    boxed[:] = arr.tolist() if items is None else items
    return _object_to_int64(boxed, field)


def validate_block_ids(
    ids: BlockIds, *, field: str = "block_ids", num_blocks: int | None = None
) -> npt.NDArray[np.int64]:
    """Check a list of block ids and return it as a 1-D int64 array.

    Args:
        ids: block ids (list, tuple, range or integer numpy array). Integral floats are accepted.
        field: the name used in error messages (``"remote_block_ids"``...).
        num_blocks: when given, every id must be below it.

    Returns:
        The ids as a 1-D int64 array (the input array itself when it already is one).

    Raises:
        BlockIdError: an id is negative, not an integer, or ``>= num_blocks``; the message names
            ``field[position]`` and the offending value. Also for input that is not 1-D.
        ConfigError: `num_blocks` itself is negative.
    """
    if num_blocks is not None and (isinstance(num_blocks, bool) or num_blocks < 0):
        raise ConfigError("num_blocks", num_blocks, "a non-negative integer")
    arr = _coerce_int64(ids, field)
    if arr.size == 0:
        return arr
    position = _first_bad(arr < 0)
    if position is not None:
        raise _bad_id(field, position, int(arr[position]), "a non-negative block id")
    if num_blocks is not None:
        position = _first_bad(arr >= num_blocks)
        if position is not None:
            raise _bad_id(field, position, int(arr[position]), f"a block id below num_blocks={num_blocks}")
    return arr


def _run_bounds(breaks: npt.NDArray[np.bool_], n: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Start positions and lengths of runs, given ``breaks[i]`` = "a run ends between i and i+1"."""
    cut = np.flatnonzero(breaks) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), cut))
    ends = np.concatenate((cut, np.array([n], dtype=np.int64)))
    return starts, ends - starts


def contiguous_runs(ids: BlockIds) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Split ids into maximal runs where each id is the previous plus one.

    Example: ``[3, 4, 5, 9, 10, 2]`` -> starts ``[3, 9, 2]``, lengths ``[3, 2, 1]``.

    Args:
        ids: block ids, validated as in `validate_block_ids`.

    Returns:
        ``(starts, lengths)``: the first id of each run and its length (int64 arrays).

    Raises:
        BlockIdError: `ids` is not a valid block-id list.
    """
    arr = validate_block_ids(ids, field="ids")
    if arr.size == 0:
        return arr.copy(), arr.copy()
    positions, lengths = _run_bounds(np.diff(arr) != 1, arr.size)
    return arr[positions], lengths


def _equal_length_pair(
    a: BlockIds, b: BlockIds, field_a: str, field_b: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    arr_a = validate_block_ids(a, field=field_a)
    arr_b = validate_block_ids(b, field=field_b)
    if arr_a.size != arr_b.size:
        raise BlockIdError(
            field_b, f"<{arr_b.size} ids>", f"as many ids as {field_a} ({arr_a.size}): one per block pair"
        )
    return arr_a, arr_b


def paired_runs(
    remote_ids: BlockIds, local_ids: BlockIds
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Split parallel id lists into runs where BOTH sides advance by exactly one.

    Example: remote ``[7, 8, 9, 12]``, local ``[2, 3, 5, 6]`` -> remote starts ``[7, 9, 12]``, local
    starts ``[2, 5, 6]``, lengths ``[2, 1, 1]``.

    Args:
        remote_ids: the peer's block ids.
        local_ids: this side's block ids, one per remote id.

    Returns:
        ``(remote_starts, local_starts, lengths)`` as int64 arrays.

    Raises:
        BlockIdError: either list is invalid, or the lengths differ (names ``local_ids``).
    """
    remote, local = _equal_length_pair(remote_ids, local_ids, "remote_ids", "local_ids")
    if remote.size == 0:
        return remote.copy(), local.copy(), remote.copy()
    breaks = (np.diff(remote) != 1) | (np.diff(local) != 1)
    positions, lengths = _run_bounds(breaks, remote.size)
    return remote[positions], local[positions], lengths


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ConfigError(name, value, "a positive integer")
    return int(value)


def group_concurrent_contiguous(
    a: BlockIds,
    b: BlockIds,
    *,
    stride_a: int = 1,
    stride_b: int = 1,
    length: int = 1,
) -> tuple[list[list[int]], list[list[int]]]:
    """Group parallel id lists into runs that are byte-contiguous on both sides.

    A run breaks between positions i and i+1 unless ``(a[i+1] - a[i]) * stride_a == length`` and
    ``(b[i+1] - b[i]) * stride_b == length``. The defaults (1, 1, 1) mean "id-contiguous".
    Examples: ``a=[1, 2, 3, 5, 6]``, ``b=[10, 11, 12, 14, 15]`` -> ``[[1, 2, 3], [5, 6]]`` and
    ``[[10, 11, 12], [14, 15]]``; ``a=[1, 2]``, ``b=[10, 11]`` with strides 4096/2048 and length 1024
    -> singletons. Empty input gives two empty lists.

    Args:
        a: remote block ids.
        b: local block ids, one per remote id.
        stride_a: bytes between consecutive blocks on side a.
        stride_b: bytes between consecutive blocks on side b.
        length: bytes copied per block.

    Returns:
        ``(groups_a, groups_b)``: the ids of each run, as lists of Python ints.

    Raises:
        BlockIdError: an id list is invalid or the lengths differ.
        ConfigError: a stride or the length is not a positive integer.
    """
    sa, sb, ell = (
        _positive("stride_a", stride_a),
        _positive("stride_b", stride_b),
        _positive("length", length),
    )
    arr_a, arr_b = _equal_length_pair(a, b, "a", "b")
    if arr_a.size == 0:
        return [], []
    breaks = (np.diff(arr_a) * sa != ell) | (np.diff(arr_b) * sb != ell)
    cut = np.flatnonzero(breaks) + 1
    return (
        [part.tolist() for part in np.split(arr_a, cut)],
        [part.tolist() for part in np.split(arr_b, cut)],
    )
