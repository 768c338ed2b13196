"""ChunkedTokenDatabase: token ranges <-> chunk hashes <-> pool keys <-> device addresses.

Runs in: scheduler (hashing, key building) and worker processes (addresses). Pure planning.

Prefix hashing (`prefix_hashes`) is deterministic across processes and hosts: a SHA-256 chain over
the token ids of each hash block, rooted at `ascend_dist.common.hashing.stable_hash` of a namespace
(model name, hash block size, salt). Python's salted ``hash`` is never used, so ``PYTHONHASHSEED``
does not matter, and instances that differ in model name or block size never produce the same
hashes (no false hits). Chunk iteration and value preparation follow spec kv-store.md §6.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.common.hashing import stable_hash
from ascend_dist.kv_store.keys import KeyMetadata
from ascend_dist.kv_store.sizes import cdiv

__all__ = ["Chunk", "ChunkedTokenDatabase", "GroupBuffers", "GroupedHashes", "hash_root", "prefix_hashes"]


def hash_root(*namespace: str | int) -> bytes:
    """The root of a hash chain: stable over processes, different for every namespace."""
    return bytes.fromhex(stable_hash("ascend_dist.kv_store.prefix", *namespace))


def prefix_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, root: bytes) -> list[bytes]:
    """Chained hashes of every full ``block_size`` block of ``token_ids``.

    ``h[i] = sha256(h[i-1] || int64 little-endian tokens of block i)`` with ``h[-1] = root``; the
    i-th hash therefore identifies the whole prefix up to the end of block i.

    Args:
        token_ids: The prompt's token ids.
        block_size: Tokens per hash block.
        root: From `hash_root`.

    Returns:
        ``len(token_ids) // block_size`` 32-byte digests.
    """
    arr = np.asarray(token_ids, dtype="<i8")
    n = len(arr) // block_size
    view = memoryview(arr[: n * block_size].tobytes())
    step = block_size * 8
    out: list[bytes] = []
    parent = root
    sha256 = hashlib.sha256
    for i in range(n):
        h = sha256(parent)
        h.update(view[i * step : (i + 1) * step])
        parent = h.digest()
        out.append(parent)
    return out


class GroupedHashes(Sequence[bytes | str]):
    """A lazy view of fine hashes as chunk hashes: item i is the last fine hash of chunk i (§6.1)."""

    def __init__(self, hashes: Sequence[bytes | str], factor: int) -> None:
        """Wrap ``hashes``; ``factor`` fine hash blocks make one chunk."""
        self._hashes = hashes
        self._factor = factor

    def __len__(self) -> int:
        return len(self._hashes) // self._factor

    def __getitem__(self, i: int) -> bytes | str:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self._hashes[(i + 1) * self._factor - 1]


@dataclass(frozen=True)
class Chunk:
    """One chunk of one group: token span, chunk hash and the block that holds it."""

    start: int
    end: int
    chunk_hash: bytes | str
    block_id: int


@dataclass(frozen=True)
class GroupBuffers:
    """Device memory of one group: one entry per (layer, K/V part) cache tensor (spec §6.3)."""

    base_addrs: tuple[int, ...]
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    num_blocks: int = 0  # 0 = not checked

    def __post_init__(self) -> None:
        """Check the three tuples have one item per entry."""
        if not len(self.base_addrs) == len(self.block_lens) == len(self.block_strides):
            raise ConfigError("GroupBuffers", len(self.base_addrs), "equal-length address/len/stride tuples")

    @property
    def page_bytes(self) -> int:
        """Bytes of one block over every entry (the size of one whole-chunk object)."""
        return sum(self.block_lens)


ChunkFilter = Callable[[int], bool]


class ChunkedTokenDatabase:
    """Turns token ranges into chunks, pool keys and (address, size) lists for each KV group."""

    def __init__(self, metadata: Sequence[KeyMetadata], block_sizes: Sequence[int], hash_block_size: int) -> None:
        """Create the database.

        Args:
            metadata: This rank's key metadata, one per KV-cache group.
            block_sizes: Each group's chunk span in tokens (grouped block size).
            hash_block_size: Tokens per fine hash; every block size must be a multiple of it.

        Raises:
            ConfigError: Mismatched lengths or a block size that is not a multiple of the hash block.
        """
        if len(metadata) != len(block_sizes) or not block_sizes:
            raise ConfigError("metadata", len(metadata), f"one KeyMetadata per group ({len(block_sizes)})")
        for b in block_sizes:
            if b < 1 or b % hash_block_size:
                raise ConfigError("block_sizes", list(block_sizes), f"multiples of hash_block_size={hash_block_size}")
        self.metadata = tuple(metadata)
        self.block_sizes = tuple(block_sizes)
        self.hash_block_size = hash_block_size
        self._buffers: dict[int, GroupBuffers] = {}

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups."""
        return len(self.block_sizes)

    def set_buffers(self, group: int, buffers: GroupBuffers) -> None:
        """Record the device buffers of ``group`` (done by the worker at registration)."""
        self._buffers[group] = buffers

    def buffers(self, group: int) -> GroupBuffers:
        """The registered buffers of ``group``.

        Raises:
            ConfigError: The group has no registered buffers.
        """
        try:
            return self._buffers[group]
        except KeyError:
            raise ConfigError("group", group, f"a registered group ({sorted(self._buffers)})") from None

    def grouped_hashes(self, hashes: Sequence[bytes | str], group: int) -> Sequence[bytes | str]:
        """Chunk hashes of ``group`` from fine hashes (spec §6.1: ``[a,b,c,d]``, k=2 -> ``[b,d]``)."""
        factor = self.block_sizes[group] // self.hash_block_size
        return hashes if factor == 1 else GroupedHashes(hashes, factor)

    def iter_chunks(
        self,
        token_len: int,
        hashes: Sequence[bytes | str],
        group: int = 0,
        *,
        mask_num: int = 0,
        block_ids: Sequence[int] | None = None,
        skip_null_blocks: bool = False,
        chunk_filter: ChunkFilter | None = None,
        shard_rank: int = 0,
        shard_size: int = 1,
    ) -> Iterator[Chunk]:
        """Yield the chunks of ``[mask_num, token_len)`` in group ``group`` (spec §6.2).

        Args:
            token_len: Tokens covered; the last chunk may be partial.
            hashes: Fine prefix hashes of the request.
            group: KV-cache group.
            mask_num: Tokens at the start to skip (already present).
            block_ids: The group's block ids; a shorter list is tail-aligned (tail-clipped lists).
            skip_null_blocks: Skip chunks whose block id is <= 0.
            chunk_filter: Keep only chunks whose start it accepts.
            shard_rank: Keep survivors with ``index % shard_size == shard_rank``.
            shard_size: Number of shards (1 = no sharding).

        Yields:
            Chunks in token order; ``block_id`` is -1 when no block ids were given.
        """
        grouped = self.grouped_hashes(hashes, group)
        span = self.block_sizes[group]
        n = min(len(grouped), cdiv(token_len, span)) if token_len > 0 else 0
        offset = max(n - len(block_ids), 0) if block_ids is not None else 0
        survivor = 0
        for i in range(n):
            start, end = i * span, min((i + 1) * span, token_len)
            if start < mask_num or end <= start or (chunk_filter is not None and not chunk_filter(start)):
                continue
            block_id = -1
            if block_ids is not None:
                idx = i - offset
                if not 0 <= idx < len(block_ids):
                    continue
                block_id = block_ids[idx]
                if skip_null_blocks and block_id <= 0:
                    continue
            keep = shard_size <= 1 or survivor % shard_size == shard_rank
            survivor += 1
            if keep:
                yield Chunk(start, end, grouped[i], block_id)

    def key(self, chunk: Chunk, group: int = 0) -> str:
        """The pool key of ``chunk``: whole-chunk key, or a partial key for a short chunk."""
        meta = self.metadata[group]
        if chunk.end - chunk.start == self.block_sizes[group]:
            return meta.pool_key(chunk.chunk_hash)
        return meta.partial_key(chunk.chunk_hash, chunk.end - chunk.start)

    def prepare_value(
        self, start: int, end: int, block_ids: Sequence[int], group: int = 0, block_id: int | None = None
    ) -> tuple[list[int], list[int], int]:
        """Addresses and sizes of one chunk over every entry of ``group`` (spec §6.3).

        A full chunk transfers whole pages; a partial one a proportional prefix of each page.
        Example: bases ``[1000, 2000]``, lens ``[160, 320]``, B=16, ids ``[5,6,7]``: chunk (0,16) ->
        ``([1800, 3600], [160, 320])``; chunk (0, 8) -> sizes ``[80, 160]``.

        Returns:
            ``(addrs, sizes, block_id)``; empty lists when the block index is out of range.

        Raises:
            BlockIdError: The block id is outside the registered cache (it would address foreign
                memory, so nothing is transferred).
        """
        span = self.block_sizes[group]
        if block_id is None:
            idx = start // span
            if not 0 <= idx < len(block_ids):
                return [], [], -1
            block_id = block_ids[idx]
        buf = self.buffers(group)
        if block_id < 0 or (buf.num_blocks and block_id >= buf.num_blocks):
            raise BlockIdError("block_id", block_id, f"an id in [0, {buf.num_blocks}) of group {group}")
        addrs = [base + block_id * stride for base, stride in zip(buf.base_addrs, buf.block_strides, strict=True)]
        sizes = [length * (end - start) // span for length in buf.block_lens]
        return addrs, sizes, block_id
