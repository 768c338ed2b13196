"""Chunk planning of the whole-request path: which chunks move, under which keys, from/to which pieces.

Runs in: worker processes (the sending and receiving threads call it). Pure planning over the
token database: hybrid-model chunk rules (`HybridCoordinator` store masks and load ranges, null
blocks skipped), TP/PP key splits (`KeySplit`), save sharding across replica ranks, load rotation
across TP ranks, and ``BlockStored`` events.
"""

from __future__ import annotations

from collections.abc import Sequence

from ascend_dist.kv_store.backends.base import TransferBatch
from ascend_dist.kv_store.config.sizes import floor_to
from ascend_dist.kv_store.keys.coordinator import HybridCoordinator
from ascend_dist.kv_store.keys.rekey import KeySplit
from ascend_dist.kv_store.keys.token_db import Chunk, ChunkedTokenDatabase, ChunkFilter
from ascend_dist.kv_store.step_metadata import ReqMeta
from ascend_dist.kv_store.transfer.events import BlockStoredEvent

__all__ = ["ChunkPlanner"]


class ChunkPlanner:
    """Chunks, keys and pieces of one rank's loads and saves."""

    def __init__(
        self,
        token_db: ChunkedTokenDatabase,
        *,
        granularity: int,
        tp_rank: int = 0,
        put_step: int = 1,
        coordinator: HybridCoordinator | None = None,
        split: KeySplit | None = None,
    ) -> None:
        """Create the planner (the arguments as `assembly.build_worker` derives them from `PoolSpec`)."""
        self._db = token_db
        self._granularity = granularity
        self._tp_rank = tp_rank
        self._put_step = put_step
        self._coordinator = coordinator
        self._split = split

    def chunk_rules(
        self, group: int, token_len: int, *, load: bool, prompt_len: int | None = None
    ) -> tuple[ChunkFilter | None, bool]:
        """Hybrid models: which chunks of ``group`` to move, and whether to skip null blocks."""
        coord = self._coordinator
        if coord is None or coord.rules[group].kind == "full":
            return None, False
        span = self._db.block_sizes[group]
        if load:
            first, end = coord.load_range(group, floor_to(token_len, coord.align))
            return (lambda start: first <= start // span < end), True
        mask = coord.store_mask(group, token_len // span, prompt_len)
        return (None if mask is None else lambda start: start // span < len(mask) and mask[start // span]), True

    def values(self, chunk: Chunk, ids: Sequence[int], group: int) -> list[tuple[str, list[int], list[int]]]:
        """Keys, addresses and sizes of one chunk (several keys under a TP/PP key split)."""
        addrs, sizes, _ = self._db.prepare_value(chunk.start, chunk.end, ids, group, chunk.block_id)
        split = self._split
        if split is None or not split.active:
            return [(self._db.key(chunk, group), addrs, sizes)]
        num_tokens, span = chunk.end - chunk.start, self._db.block_sizes[group]
        parts = split.split(
            self._db.metadata[group], chunk.chunk_hash, self._db.buffers(group),
            block_id=chunk.block_id, num_tokens=num_tokens, span=span,
        )  # fmt: skip
        if num_tokens == span:
            return parts
        return [(f"{key}@partial:{num_tokens}", a, s) for key, a, s in parts]  # same rule as ChunkedTokenDatabase.key

    def entries(
        self, chunks: Sequence[Chunk], ids: Sequence[int], group: int
    ) -> list[tuple[Chunk, str, list[int], list[int]]]:
        """`values` of many chunks: ``(chunk, key, addrs, sizes)`` in chunk order."""
        split = self._split
        if split is None or not split.active:
            keys, addrs, sizes = self._db.chunk_values(chunks, group)
            return list(zip(chunks, keys, addrs, sizes, strict=True))
        return [(chunk, key, a, s) for chunk in chunks for key, a, s in self.values(chunk, ids, group)]

    def load_batch(self, req: ReqMeta) -> tuple[TransferBatch, list[int]]:
        """Keys, pieces and block ids one request loads, rotated by the TP rank."""
        spec = req.load_spec
        assert spec is not None
        token_len = spec.load_token_len(self._granularity, req.save_end_token)
        keys: list[str] = []
        addrs: list[list[int]] = []
        sizes: list[list[int]] = []
        blocks: list[int] = []
        for g in range(self._db.num_groups):
            ids = req.block_ids[g] if g < len(req.block_ids) else ()
            mask = floor_to(spec.vllm_cached_tokens, self._db.block_sizes[g])
            keep, skip_null = self.chunk_rules(g, token_len, load=True)
            chunks = self._db.iter_chunks(
                token_len,
                req.block_hashes,
                g,
                mask_num=mask,
                block_ids=ids,
                chunk_filter=keep,
                skip_null_blocks=skip_null,
                tail=req.tail_hash,
            )
            for chunk, key, a, s in self.entries(list(chunks), ids, g):
                keys.append(key)
                addrs.append(a)
                sizes.append(s)
                blocks.append(chunk.block_id)
        batch = TransferBatch(tuple(keys), tuple(addrs), tuple(sizes))
        k = self._tp_rank % len(keys) if keys else 0
        return batch.rotated(k), blocks[k:] + blocks[:k]

    def save_entries(
        self, reqs: Sequence[ReqMeta]
    ) -> tuple[list[str], list[tuple[list[int], list[int]]], list[tuple[int, Chunk, ReqMeta]]]:
        """Every key this rank saves for ``reqs`` (deduplicated), with its pieces and chunk."""
        keys: list[str] = []
        values: list[tuple[list[int], list[int]]] = []
        seen: set[str] = set()
        chunks: list[tuple[int, Chunk, ReqMeta]] = []
        for req, g in ((r, g) for r in reqs for g in range(self._db.num_groups)):
            ids = req.block_ids[g] if g < len(req.block_ids) else ()
            mask = floor_to(req.save_start_token, self._db.block_sizes[g])
            keep, skip_null = self.chunk_rules(g, req.save_end_token, load=False, prompt_len=req.num_prompt_tokens)
            planned = self._db.iter_chunks(
                req.save_end_token,
                req.block_hashes,
                g,
                mask_num=mask,
                block_ids=ids,
                chunk_filter=keep,
                skip_null_blocks=skip_null,
                tail=req.tail_hash,
                shard_rank=self._tp_rank % self._put_step,
                shard_size=self._put_step,
            )
            for chunk, key, a, s in self.entries(list(planned), ids, g):
                if key not in seen:  # two requests of one step may share a prefix
                    seen.add(key)
                    keys.append(key)
                    values.append((a, s))
                    chunks.append((g, chunk, req))
        return keys, values, chunks

    def stored_events(self, chunks: Sequence[tuple[int, Chunk, ReqMeta]]) -> list[BlockStoredEvent]:
        """One ``BlockStored`` event per chunk put."""
        out: list[BlockStoredEvent] = []
        for g, chunk, req in chunks:
            span = self._db.block_sizes[g]
            grouped = self._db.grouped_hashes(req.block_hashes, g)
            index = chunk.start // span
            parent = grouped[index - 1] if index > 0 else None
            out.append(BlockStoredEvent(
                block_hash=bytes.fromhex(chunk.chunk_hash) if isinstance(chunk.chunk_hash, str) else chunk.chunk_hash,
                parent_block_hash=bytes.fromhex(parent) if isinstance(parent, str) else parent,
                token_ids=req.token_ids[chunk.start : chunk.end], block_size=span,
            ))  # fmt: skip
        return out
