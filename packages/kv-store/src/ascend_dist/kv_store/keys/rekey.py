"""Key splitting: one rank's chunk as the keys another parallel layout stores (TP sub-keys, PP re-keying).

Runs in: worker processes. Pure planning, used by the worker's save
and load paths; upstream computed both but no longer dispatched to them.

* **TP mismatch** (GQA, prefill and decode with different TP): the pool is keyed in the larger
  TP's layout. A rank of the smaller TP holds ``num_sub_keys`` of those ranks' heads; it moves each
  sub-key as per-token strided pieces of its pages (``base + block*stride + t*per_token +
  s*sub_bytes``, ``sub_bytes = per_token / num_sub_keys``), whose concatenation is byte for byte the
  object the larger-TP rank stores. Pages must be token-major (``[block, token, head, dim]``).
* **PP re-keying** (a decode instance without PP saving for, or loading from, a PP prefill): the
  entries of every chunk are cut into the prefill's stage partitions (layers per stage) and each
  slice goes under that stage's ``pp_rank`` key.

Both apply to loads as well as saves, so the smaller layout can also read the larger one's objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_store.keys.keys import KeyMetadata
from ascend_dist.kv_store.keys.token_db import GroupBuffers

__all__ = ["KeySplit"]

KeyValue = tuple[str, list[int], list[int]]


@dataclass(frozen=True)
class KeySplit:
    """How this rank's chunks map onto the pool's key layout."""

    tp_rank: int = 0
    num_sub_keys: int = 1
    pp_parts: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        """Whether chunks are split at all."""
        return self.num_sub_keys > 1 or len(self.pp_parts) > 1

    def check(self, buffers: GroupBuffers, span: int) -> None:
        """Validate against the registered buffers.

        Raises:
            ConfigError: The PP partition does not cover the registered layers, or a page cannot be
                split into ``num_sub_keys`` equal per-token head slices.
        """
        if len(self.pp_parts) > 1 and sum(self.pp_parts) != buffers.num_layers:
            raise ConfigError(
                "prefill_pp_layer_partition", list(self.pp_parts), f"layer counts summing to {buffers.num_layers}"
            )
        if self.num_sub_keys > 1 and any(n % (span * self.num_sub_keys) for n in buffers.block_lens):
            raise ConfigError(
                "prefill_tp_size/decode_tp_size", self.num_sub_keys, "sub-keys dividing each page's heads"
            )

    def _parts(self, meta: KeyMetadata, buffers: GroupBuffers) -> list[tuple[int, int, int]]:
        if len(self.pp_parts) <= 1:
            return [(meta.pp_rank, 0, len(buffers.base_addrs))]
        out = []
        first = 0
        for pp, count in enumerate(self.pp_parts):
            lo, hi = buffers.layer_offsets[first], buffers.layer_offsets[first + count]
            out.append((pp, lo, hi))
            first += count
        return out

    def split(
        self,
        meta: KeyMetadata,
        chunk_hash: bytes | str,
        buffers: GroupBuffers,
        *,
        block_id: int,
        num_tokens: int,
        span: int,
    ) -> list[KeyValue]:
        """The keys, addresses and sizes of one chunk (``num_tokens`` of a ``span``-token block).

        Example: 8 KV heads, decode TP2 for a TP4 prefill, rank 1 -> sub-keys with
        ``head_or_tp_rank`` 2 and 3; a page of 64 bytes over 4 tokens, stride 128, block 2, base
        1000, sub-key 1 -> pieces at 1264, 1280, 1296, 1312 of 8 bytes each.
        """
        out: list[KeyValue] = []
        for pp, lo, hi in self._parts(meta, buffers):
            for s in range(self.num_sub_keys):
                head = self.tp_rank * self.num_sub_keys + s if self.num_sub_keys > 1 else meta.head_or_tp_rank
                key = meta.for_rank(head=head, pp=pp, pcp=meta.pcp_rank, dcp=meta.dcp_rank).pool_key(chunk_hash)
                addrs, sizes = self._pieces(
                    buffers, range(lo, hi), block_id=block_id, sub=s, num_tokens=num_tokens, span=span
                )
                out.append((key, addrs, sizes))
        return out

    def _pieces(
        self, buffers: GroupBuffers, entries: Sequence[int], *, block_id: int, sub: int, num_tokens: int, span: int
    ) -> tuple[list[int], list[int]]:
        addrs: list[int] = []
        sizes: list[int] = []
        for e in entries:
            base = buffers.base_addrs[e] + block_id * buffers.block_strides[e]
            if self.num_sub_keys == 1:
                addrs.append(base)
                sizes.append(buffers.block_lens[e] * num_tokens // span)
                continue
            per_token = buffers.block_lens[e] // span
            sub_bytes = per_token // self.num_sub_keys
            for t in range(num_tokens):
                addrs.append(base + t * per_token + sub * sub_bytes)
                sizes.append(sub_bytes)
        return addrs, sizes
