"""ChunkedTokenDatabase: token ranges <-> chunk hashes <-> pool keys <-> device addresses.

Runs in: scheduler (hashing, key building) and worker processes (addresses). Pure planning.

Prefix hashing (`prefix_hashes`) is deterministic across processes and hosts: a SHA-256 chain over
the token ids of each hash block, rooted at `ascend_dist.common.hashing.stable_hash` of a namespace
(model name, hash block size, salt). Python's salted ``hash`` is never used, so ``PYTHONHASHSEED``
does not matter, and instances that differ in model name or block size never produce the same
hashes (no false hits).
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.common.hashing import stable_hash
from ascend_dist.kv_store.config.sizes import cdiv
from ascend_dist.kv_store.keys.keys import KeyMetadata

__all__ = [
    "Chunk",
    "ChunkFilter",
    "ChunkedTokenDatabase",
    "GroupBuffers",
    "GroupedHashes",
    "hash_root",
    "prefix_hashes",
]


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
    data = _token_bytes(token_ids)
    n = len(data) // 8 // block_size
    step = block_size * 8
    out: list[bytes] = []
    parent = root
    sha256 = hashlib.sha256
    for i in range(0, n * step, step):
        parent = sha256(parent + data[i : i + step]).digest()  # one call: ~2x faster than update()
        out.append(parent)
    return out


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as int64 little-endian bytes (``array`` is ~1.6x faster than numpy for a list)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.astype("<i8", copy=False).tobytes()
    arr = array.array("q", token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def tail_hash(
    token_ids: Sequence[int] | np.ndarray, hashes: Sequence[bytes], span: int, hash_block_size: int, root: bytes
) -> bytes | None:
    """Hash of the partial last chunk ``[floor_to(len, span), len)`` of ``token_ids``; None if aligned.

    Chained to the previous chunk's hash (or ``root``) and domain-separated from whole-chunk hashes,
    so a partial object never answers for a whole chunk (upstream keyed it with the whole block's
    hash). It identifies the exact prompt, so only a request with the same prompt reuses it.
    """
    start = len(token_ids) // span * span
    if start == len(token_ids):
        return None
    idx = start // hash_block_size - 1
    if idx >= len(hashes):
        return None
    parent = hashes[idx] if idx >= 0 else root
    h = hashlib.sha256(b"partial\x00" + parent)
    h.update(np.asarray(token_ids[start:], dtype="<i8").tobytes())
    return h.digest()


class GroupedHashes(Sequence[bytes | str]):
    """A lazy view of fine hashes as chunk hashes: item i is the last fine hash of chunk i."""

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
    """Device memory of one group: one entry per (layer, K/V part) cache tensor."""

    base_addrs: tuple[int, ...]
    block_lens: tuple[int, ...]
    block_strides: tuple[int, ...]
    num_blocks: int = 0  # 0 = not checked
    layer_names: tuple[str, ...] = ()  # the group's layers in entry order (layer-wise transfers)
    layer_offsets: tuple[int, ...] = ()  # first entry of each layer, plus the entry count at the end

    def __post_init__(self) -> None:
        """Check the three tuples have one item per entry and the layer offsets cover them."""
        if not len(self.base_addrs) == len(self.block_lens) == len(self.block_strides):
            raise ConfigError("GroupBuffers", len(self.base_addrs), "equal-length address/len/stride tuples")
        if self.layer_offsets and (
            len(self.layer_offsets) != len(self.layer_names) + 1 or self.layer_offsets[-1] != len(self.base_addrs)
        ):
            raise ConfigError("layer_offsets", self.layer_offsets, "one offset per layer plus the entry count")

    @property
    def num_layers(self) -> int:
        """Layers of the group (0 when registered without layer information)."""
        return len(self.layer_names)

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
        """Chunk hashes of ``group`` from fine hashes (``[a,b,c,d]``, k=2 -> ``[b,d]``)."""
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
        tail: bytes | None = None,
    ) -> Iterator[Chunk]:
        """Yield the chunks of ``[mask_num, token_len)`` in group ``group``.

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
            tail: Hash of the partial chunk right after the last whole chunk (`tail_hash`); without
                it a partial chunk has no hash and is skipped.

        Yields:
            Chunks in token order; ``block_id`` is -1 when no block ids were given.
        """
        grouped = self.grouped_hashes(hashes, group)
        span = self.block_sizes[group]
        whole = len(grouped)
        usable = whole + 1 if tail is not None and token_len % span and token_len // span == whole else whole
        n = min(usable, cdiv(token_len, span)) if token_len > 0 else 0
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
                yield Chunk(start, end, grouped[i] if i < whole else tail, block_id)  # type: ignore[arg-type]

    def key(self, chunk: Chunk, group: int = 0) -> str:
        """The pool key of ``chunk``: whole-chunk key, or a partial key for a short chunk."""
        meta = self.metadata[group]
        if chunk.end - chunk.start == self.block_sizes[group]:
            return meta.pool_key(chunk.chunk_hash)
        return meta.partial_key(chunk.chunk_hash, chunk.end - chunk.start)

    def prepare_value(
        self, start: int, end: int, block_ids: Sequence[int], group: int = 0, block_id: int | None = None
    ) -> tuple[list[int], list[int], int]:
        """Addresses and sizes of one chunk over every entry of ``group``.

        A full chunk transfers whole pages; a partial one a proportional prefix of each page.
        Example: bases ``[1000, 2000]``, lens ``[160, 320]``, B=16, ids ``[5,6,7]``: chunk (0,16) ->
        ``([1800, 3600], [160, 320])``; chunk (0, 8) -> sizes ``[80, 160]``.

        Returns:
            ``(addrs, sizes, block_id)``; empty lists when the block index is out of range.

        Raises:
            BlockIdError: The block id is outside the registered cache (it would address foreign
                memory, so nothing is transferred).
        """
        return self._value(start, end, block_ids, group=group, block_id=block_id, entries=None)

    def prepare_value_layer(
        self, start: int, end: int, block_ids: Sequence[int], layer: int, *, group: int = 0, block_id: int | None = None
    ) -> tuple[list[int], list[int], int]:
        """`prepare_value` restricted to the entries (K, V, ...) of one layer (key-layer path).

        Raises:
            BlockIdError: The block id is outside the registered cache.
            ConfigError: ``layer`` is not a registered layer of ``group``.
        """
        buf = self.buffers(group)
        if not 0 <= layer < buf.num_layers:
            raise ConfigError("layer", layer, f"a layer index in [0, {buf.num_layers}) of group {group}")
        entries = (buf.layer_offsets[layer], buf.layer_offsets[layer + 1])
        return self._value(start, end, block_ids, group=group, block_id=block_id, entries=entries)

    def _value(
        self,
        start: int,
        end: int,
        block_ids: Sequence[int],
        *,
        group: int,
        block_id: int | None,
        entries: tuple[int, int] | None,
    ) -> tuple[list[int], list[int], int]:
        span = self.block_sizes[group]
        if block_id is None:
            idx = start // span
            if not 0 <= idx < len(block_ids):
                return [], [], -1
            block_id = block_ids[idx]
        buf = self.buffers(group)
        if block_id < 0 or (buf.num_blocks and block_id >= buf.num_blocks):
            raise BlockIdError("block_id", block_id, f"an id in [0, {buf.num_blocks}) of group {group}")
        bases, strides, lens = buf.base_addrs, buf.block_strides, buf.block_lens
        if entries is not None:
            lo, hi = entries
            bases, strides, lens = bases[lo:hi], strides[lo:hi], lens[lo:hi]
        addrs = [base + block_id * stride for base, stride in zip(bases, strides, strict=True)]
        num = end - start
        sizes = list(lens) if num == span else [n * num // span for n in lens]
        return addrs, sizes, block_id

    def chunk_values(
        self, chunks: Sequence[Chunk], group: int = 0, *, layer: int | None = None
    ) -> tuple[list[str], list[list[int]], list[list[int]]]:
        """Keys, addresses and sizes of many chunks at once (of one ``layer``'s objects when given).

        The same as `key` and `prepare_value` (or `layer_key` and `prepare_value_layer`) per chunk,
        which cost ~3 us each and add up to milliseconds per step of a few 8k-token prompts; this
        does the arithmetic in comprehensions (~1 us per chunk). Whole chunks share one sizes list
        (callers must not mutate it).

        Raises:
            BlockIdError: A chunk's block id is outside the registered cache.
            ConfigError: ``layer`` is not a registered layer of ``group``.
        """
        if not chunks:
            return [], [], []
        buf = self.buffers(group)
        ids = [c.block_id for c in chunks]
        low, high = min(ids), max(ids)
        if low < 0 or (buf.num_blocks and high >= buf.num_blocks):
            bad = low if low < 0 else high
            raise BlockIdError("block_id", bad, f"an id in [0, {buf.num_blocks}) of group {group}")
        bases, strides, lens = buf.base_addrs, buf.block_strides, buf.block_lens
        if layer is not None:
            if not 0 <= layer < buf.num_layers:
                raise ConfigError("layer", layer, f"a layer index in [0, {buf.num_layers}) of group {group}")
            lo, hi = buf.layer_offsets[layer], buf.layer_offsets[layer + 1]
            bases, strides, lens = bases[lo:hi], strides[lo:hi], lens[lo:hi]
        span = self.block_sizes[group]
        entries = list(zip(bases, strides, strict=True))
        whole_sizes = list(lens)
        addrs = [[base + bid * stride for base, stride in entries] for bid in ids]
        sizes = [
            whole_sizes if c.end - c.start == span else [n * (c.end - c.start) // span for n in whole_sizes]
            for c in chunks
        ]
        prefix = self.metadata[group].prefix
        if layer is not None:
            prefix = f"{prefix}layer_id:{layer}@"
        elif any(s is not whole_sizes for s in sizes):
            return [self.key(c, group) for c in chunks], addrs, sizes
        keys = [prefix + (h if isinstance(h := c.chunk_hash, str) else h.hex()) for c in chunks]
        return keys, addrs, sizes

    def layer_key(self, chunk: Chunk, layer: int, group: int = 0) -> str:
        """The per-layer key of a whole chunk (``...@layer_id:{L}@{hash}``, includes ``pp_rank``)."""
        return self.metadata[group].layer_key(chunk.chunk_hash, layer)
