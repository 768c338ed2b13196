"""Heterogeneous TP between prefill and decode (GQA): sub-keys and strided addresses.

Runs in: scheduler and worker processes. Pure planning. Upstream computed this but no longer
dispatched to it. Here `TpMismatchInfo` decides the pool's key layout (`PoolSpec`) and
the worker moves sub-keys through `ascend_dist.kv_store.keys.rekey.KeySplit`, whose addresses follow
`strided_sub_key_addresses`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TpMismatchInfo", "strided_sub_key_addresses"]


@dataclass(frozen=True)
class TpMismatchInfo:
    """How a rank's KV heads map onto the peer's TP layout."""

    enabled: bool
    effective_tp: int
    local_heads_per_rank: int
    effective_heads_per_rank: int
    num_sub_keys: int

    @classmethod
    def compute(
        cls, *, local_tp: int, peer_tp: int | None, num_kv_heads: int, use_mla: bool = False, use_hybrid: bool = False
    ) -> TpMismatchInfo:
        """Derive the info; a missing or non-positive ``peer_tp`` means "same as local".

        Example: 8 KV heads, decode TP2, prefill TP4 -> effective 4, heads/rank 4 -> 2, 2 sub-keys.
        """
        peer = peer_tp if peer_tp is not None and peer_tp > 0 else local_tp
        effective = max(local_tp, peer)
        enabled = (
            peer != local_tp and not use_mla and not use_hybrid
            and num_kv_heads >= effective and num_kv_heads % effective == 0
        )  # fmt: skip
        local_heads = num_kv_heads // local_tp if local_tp <= num_kv_heads else 1
        eff_heads = num_kv_heads // effective if enabled else local_heads
        return cls(enabled, effective, local_heads, eff_heads, local_heads // eff_heads if enabled else 1)

    def sub_key_ranks(self, tp_rank: int) -> list[int]:
        """``head_or_tp_rank`` of each sub-key this rank writes (rank 1 of 2 sub-keys -> 2, 3)."""
        return [tp_rank * self.num_sub_keys + s for s in range(self.num_sub_keys)]


def strided_sub_key_addresses(
    *,
    base: int,
    block_id: int,
    block_stride: int,
    block_len: int,
    block_size: int,
    sub: int,
    sub_bytes: int,
    num_tokens: int,
) -> list[tuple[int, int]]:
    """(address, size) per token of one sub-key's head slice in one block.

    Example: block_len 64, B 4 (16 B/token), stride 128, block 2, sub 1, 8 bytes, 3 tokens ->
    addresses 1264, 1280, 1296 (base 1000), 8 bytes each.
    """
    per_token = block_len // block_size
    start = base + block_id * block_stride + sub * sub_bytes
    return [(start + t * per_token, sub_bytes) for t in range(num_tokens)]
