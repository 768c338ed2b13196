"""P2P transfer descriptors: per-tensor base addresses x block runs.

Runs in: worker processes, once per transfer task. Pure numpy: no torch, no I/O.

A descriptor is ``(local address, remote address, length)``: one contiguous piece a transfer engine
moves. For every KV tensor c of every layer (K and V are separate tensors on Ascend; MLA's nope and
rope parts too) and every block pair, the addresses are::

    local  = local_base[c]  + local_id  * local_stride[c]  + local_offset[c]
    remote = remote_base[c] + remote_id * remote_stride[c] + remote_offset[c]
    length = block_len[c]

When both strides equal the copy length, blocks whose ids advance together on both sides are
byte-contiguous on both sides, so a run of n blocks becomes one descriptor of ``n * block_len``
bytes. Runs are computed once per request and broadcast over all tensors with numpy: building the
descriptors of 61 layers x K/V x 1,000 blocks is a handful of array operations, not 122,000 Python
iterations. Fewer descriptors also matter for the engine: Mooncake over TCP fails a batch with more
than 2048 pieces per peer, hence `split_descriptors_by_limit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

import numpy as np
import numpy.typing as npt

from ascend_dist.common._address_arrays import AddressTriple
from ascend_dist.common.blocks import BlockIds, paired_runs, validate_block_ids
from ascend_dist.common.errors import BlockIdError, ConfigError

__all__ = [
    "MOONCAKE_TCP_MAX_PIECES",
    "Descriptors",
    "IntOrArray",
    "build_block_descriptors",
    "build_layer_descriptors",
    "descriptors_from_runs",
    "split_descriptors_by_limit",
]

# Mooncake's TCP transport fails a batch with more pieces than this for one peer.
MOONCAKE_TCP_MAX_PIECES = 2048

# A per-tensor parameter: one int for all tensors, one per part, or one per tensor (1-D or
# [layer][part]); broadcast against the bases. Bases themselves are 1-D or [layer][part].
IntOrArray: TypeAlias = int | Sequence[int] | Sequence[Sequence[int]] | npt.NDArray[np.integer]

_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class Descriptors(AddressTriple):
    """Parallel arrays of transfer pieces: local address, remote address, length in bytes.

    The arrays are copied into read-only int64 arrays of equal length on construction. Also offers
    ``len()``, `total_bytes`, `empty()`, `concat(...)`, `slice(start, stop)` and `split(limit)`.

    Raises:
        ConfigError: the arrays differ in length, are not 1-D integers, an address is negative or a
            length is not positive.
    """

    COLUMNS: ClassVar[tuple[str, str, str]] = ("local", "remote", "lengths")

    local: _I64
    remote: _I64
    lengths: _I64

    def __post_init__(self) -> None:
        self._freeze()


def _per_tensor(name: str, value: IntOrArray, shape: tuple[int, ...]) -> _I64:
    """Broadcast a per-tensor parameter against the bases' shape and flatten it."""
    arr = np.asarray(value)
    if arr.size and arr.dtype.kind not in "iu":
        raise ConfigError(name, value, "an integer or a sequence of integers")
    try:
        return np.broadcast_to(arr.astype(np.int64), shape).reshape(-1)
    except ValueError as exc:
        raise ConfigError(name, f"<shape {arr.shape}>", f"a shape that broadcasts to the bases' {shape}") from exc


def _check_at_least(name: str, arr: _I64, low: _I64 | int, expected: str) -> None:
    bad = np.flatnonzero(arr < low)
    if bad.size:
        raise ConfigError(f"{name}[{bad[0]}]", int(arr[bad[0]]), expected)


def _broadcast(bases: _I64, strides: _I64, offsets: _I64, starts: _I64) -> _I64:
    """``bases[t] + starts[r] * strides[t] + offsets[t]`` for every tensor t, run r (tensor-major)."""
    return (bases[:, None] + starts[None, :] * strides[:, None] + offsets[:, None]).reshape(-1)


def descriptors_from_runs(
    local_base: int,
    remote_base: int,
    local_starts: BlockIds,
    remote_starts: BlockIds,
    run_lengths: BlockIds,
    *,
    local_stride: int,
    remote_stride: int,
    length: int,
    local_offset: int = 0,
    remote_offset: int = 0,
) -> Descriptors:
    """Turn caller-chosen runs into descriptors, one per run, without re-checking contiguity.

    Address arithmetic: local ``base + L0 * stride + offset``, remote
    ``base + R0 * stride + offset``, length ``length * run_length``. For runs that were grouped by
    another rule (e.g. the replicated-indexer lists of 5.15); prefer `build_block_descriptors`, which
    only merges blocks that really are byte-contiguous.

    Args:
        local_base: address of local block 0.
        remote_base: address of remote block 0.
        local_starts: the first local id of each run.
        remote_starts: the first remote id of each run.
        run_lengths: the number of blocks in each run (> 0).
        local_stride: bytes between local blocks.
        remote_stride: bytes between remote blocks.
        length: bytes per block.
        local_offset: bytes added to every local address.
        remote_offset: bytes added to every remote address.

    Returns:
        One descriptor per run.

    Raises:
        BlockIdError: the run arrays are invalid or differ in length.
        ConfigError: a geometry value is negative (length: not positive).
    """
    ls = validate_block_ids(local_starts, field="local_starts")
    rs = validate_block_ids(remote_starts, field="remote_starts")
    n = validate_block_ids(run_lengths, field="run_lengths")
    if not ls.size == rs.size == n.size:
        raise BlockIdError("run_lengths", f"<{n.size}, {rs.size}, {ls.size}>", "one entry per run on each side")
    _check_at_least("run_lengths", n, 1, "a positive run length")
    geometry = {"local_stride": local_stride, "remote_stride": remote_stride, "length": length}
    geometry |= {"local_offset": local_offset, "remote_offset": remote_offset}
    for name, value in geometry.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "length" else 0):
            raise ConfigError(name, value, "a positive integer" if name == "length" else "a non-negative integer")
    one = np.ones(1, dtype=np.int64)
    return Descriptors(
        _broadcast(one * local_base, one * local_stride, one * local_offset, ls),
        _broadcast(one * remote_base, one * remote_stride, one * remote_offset, rs),
        n * length,
    )


def build_block_descriptors(
    local_base: int,
    remote_base: int,
    local_ids: BlockIds,
    remote_ids: BlockIds,
    *,
    local_stride: int,
    remote_stride: int,
    length: int,
    local_offset: int = 0,
    remote_offset: int = 0,
) -> Descriptors:
    """Descriptors for one tensor: contiguous block runs merged when both strides equal `length`.

    Example: local base 0x1000, remote 0x3000, strides and length 1024, local
    ``[2, 3, 4]``, remote ``[7, 8, 9]`` -> one descriptor ``(0x1000 + 2048, 0x3000 + 7168, 3072)``.

    Args:
        local_base: address of local block 0.
        remote_base: address of remote block 0.
        local_ids: local block ids.
        remote_ids: remote block ids, one per local id.
        local_stride: bytes between local blocks (>= length).
        remote_stride: bytes between remote blocks (>= length).
        length: bytes copied per block (e.g. ``block_len / pulls`` for a GQA pull).
        local_offset: bytes into each local block where the copy lands (``pull_offset * length``).
        remote_offset: bytes into each remote block where the copy starts.

    Returns:
        The descriptors in block order.

    Raises:
        BlockIdError: an id list is invalid or the lengths differ.
        ConfigError: a negative base or offset, a non-positive length, a stride below the length, or
            an offset that pushes the copy past the end of its block.
    """
    return build_layer_descriptors(
        [local_base],
        [remote_base],
        local_ids,
        remote_ids,
        block_len=length,
        local_stride=local_stride,
        remote_stride=remote_stride,
        local_offset=local_offset,
        remote_offset=remote_offset,
    )


def _tensor_geometry(
    local_bases: IntOrArray,
    remote_bases: IntOrArray,
    *,
    block_len: IntOrArray,
    strides: dict[str, IntOrArray | None],
    offsets: dict[str, IntOrArray],
) -> dict[str, _I64]:
    """Flatten the bases, broadcast every per-tensor parameter to them and validate the geometry.

    Returns:
        Flat int64 arrays keyed ``local_bases``, ``remote_bases``, ``length``, ``{side}_stride`` and
        ``{side}_offset`` for side in local/remote.
    """
    lb = np.asarray(local_bases)
    rb = np.asarray(remote_bases)
    if lb.ndim not in (1, 2):
        raise ConfigError("local_bases", f"<shape {lb.shape}>", "a 1-D (tensors) or 2-D (layers x parts) array")
    if rb.shape != lb.shape:
        raise ConfigError("remote_bases", f"<shape {rb.shape}>", f"the shape of local_bases {lb.shape}")
    shape = lb.shape
    length = _per_tensor("block_len", block_len, shape)
    geo = {
        "local_bases": _per_tensor("local_bases", lb, shape),
        "remote_bases": _per_tensor("remote_bases", rb, shape),
        "length": length,
    }
    _check_at_least("local_bases", geo["local_bases"], 0, "a non-negative address")
    _check_at_least("remote_bases", geo["remote_bases"], 0, "a non-negative address")
    _check_at_least("block_len", length, 1, "a positive byte count")
    for side in ("local", "remote"):
        given = strides[side]
        stride = length if given is None else _per_tensor(f"{side}_stride", given, shape)
        offset = _per_tensor(f"{side}_offset", offsets[side], shape)
        _check_at_least(f"{side}_stride", stride, length, "a stride >= block_len (blocks must not overlap)")
        _check_at_least(f"{side}_offset", offset, 0, "a non-negative byte offset")
        _check_at_least(f"{side}_stride", stride, offset + length, "room for offset + block_len in each block")
        geo[f"{side}_stride"], geo[f"{side}_offset"] = stride, offset
    return geo


def build_layer_descriptors(
    local_bases: IntOrArray,
    remote_bases: IntOrArray,
    local_ids: BlockIds,
    remote_ids: BlockIds,
    *,
    block_len: IntOrArray,
    local_stride: IntOrArray | None = None,
    remote_stride: IntOrArray | None = None,
    local_offset: IntOrArray = 0,
    remote_offset: IntOrArray = 0,
) -> Descriptors:
    """Descriptors for many tensors sharing one block-id pairing (all layers of a KV group).

    Bases are either 1-D (one per tensor) or 2-D ``[layer][part]`` (split K/V: 2 parts; MLA nope/rope:
    2 parts with different `block_len`). Every other parameter is an int or broadcasts against the
    bases' shape (a length-``parts`` sequence gives one value per part). Block runs are computed once
    and broadcast over all tensors. Output order: tensor-major (layer, then part), then block order.

    Args:
        local_bases: address of block 0 of each local tensor.
        remote_bases: address of block 0 of each remote tensor (same shape).
        local_ids: local block ids.
        remote_ids: remote block ids, one per local id.
        block_len: bytes copied per block, per tensor.
        local_stride: bytes between local blocks per tensor; default `block_len` (contiguous).
        remote_stride: bytes between remote blocks per tensor; default `block_len`.
        local_offset: bytes into each local block where the copy lands.
        remote_offset: bytes into each remote block where the copy starts.

    Returns:
        The descriptors. Tensors whose strides both equal their `block_len` get one descriptor per
        paired run; the others one per block.

    Raises:
        BlockIdError: an id list is invalid or the lengths differ.
        ConfigError: bad geometry (shapes that do not broadcast, negative values, a stride below
            ``offset + block_len``).
    """
    geo = _tensor_geometry(
        local_bases,
        remote_bases,
        block_len=block_len,
        strides={"local": local_stride, "remote": remote_stride},
        offsets={"local": local_offset, "remote": remote_offset},
    )
    local = validate_block_ids(local_ids, field="local_ids")
    remote = validate_block_ids(remote_ids, field="remote_ids")
    if local.size != remote.size:
        raise BlockIdError("remote_ids", f"<{remote.size} ids>", f"one per local id ({local.size})")
    length = geo["length"]
    if local.size == 0 or length.size == 0:
        return Descriptors.empty()
    merge = (geo["local_stride"] == length) & (geo["remote_stride"] == length)
    pieces: list[tuple[_I64, Descriptors]] = []
    if merge.any():
        r_starts, l_starts, counts = paired_runs(remote, local)
        pieces.append((np.flatnonzero(merge), _emit(geo, merge, l_starts, r_starts, counts)))
    if not merge.all():
        ones = np.ones(local.size, dtype=np.int64)
        pieces.append((np.flatnonzero(~merge), _emit(geo, ~merge, local, remote, ones)))
    if len(pieces) == 1:
        return pieces[0][1]
    # Mixed tensors: restore tensor-major order with a stable sort on the tensor index.
    owner = np.concatenate([np.repeat(idx, len(d) // idx.size) for idx, d in pieces])
    order = np.argsort(owner, kind="stable")
    joined = Descriptors.concat([d for _, d in pieces])
    return Descriptors(joined.local[order], joined.remote[order], joined.lengths[order])


def _emit(
    geo: dict[str, _I64], mask: npt.NDArray[np.bool_], l_starts: _I64, r_starts: _I64, counts: _I64
) -> Descriptors:
    """Broadcast runs over the tensors selected by `mask`."""
    return Descriptors(
        _broadcast(geo["local_bases"][mask], geo["local_stride"][mask], geo["local_offset"][mask], l_starts),
        _broadcast(geo["remote_bases"][mask], geo["remote_stride"][mask], geo["remote_offset"][mask], r_starts),
        (geo["length"][mask][:, None] * counts[None, :]).reshape(-1),
    )


def split_descriptors_by_limit(d: Descriptors, limit: int = MOONCAKE_TCP_MAX_PIECES) -> list[Descriptors]:
    """Cut a batch into consecutive batches of at most `limit` pieces (order kept).

    Args:
        d: the batch.
        limit: the most pieces one engine call may carry (Mooncake TCP: 2048 per peer).

    Returns:
        The batches, in order; an empty list for an empty batch.

    Raises:
        ConfigError: `limit` is not a positive integer.
    """
    return d.split(limit)
