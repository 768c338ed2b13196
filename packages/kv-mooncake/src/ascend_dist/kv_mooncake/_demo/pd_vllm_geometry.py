"""The ``pd-vllm`` bench's KV shapes (no vLLM, no torch: the CLI lists the scenario without them).

Runs in: the ``ascend-dist bench`` process.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LARGE", "QUICK", "SMALL", "Shape"]


@dataclass(frozen=True)
class Shape:
    """One wave: ``requests`` prompts of ``tokens`` tokens over a model of this KV shape (float16)."""

    name: str
    requests: int
    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    block: int = 32
    waves: int = 3

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]

    @property
    def block_bytes(self) -> int:
        """One block of one layer, K and V."""
        return self.block * self.kv_heads * 2 * self.head_dim * 2

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.block)

    @property
    def num_blocks(self) -> int:
        """Room for a whole wave (one decode token each) plus vLLM's null block."""
        return self.requests * (-(-(self.tokens + 1) // self.block)) + 2

    @property
    def request_bytes(self) -> int:
        """What one request moves: every prompt block of every layer (both connectors move whole blocks)."""
        return self.blocks_per_request * self.layers * self.block_bytes

    @property
    def wave_bytes(self) -> int:
        return self.requests * self.request_bytes


LARGE = Shape("large", requests=8, layers=8, kv_heads=8, head_dim=128, tokens=1024)
"""The issue's large shape at 1,024 tokens (32 blocks, 32 MiB per request): 8 x 8 layers x 8 KV heads x 128, block 32.

Not 1,100: vLLM's P writes every request ready in a step in one ``batch_transfer_sync_write``, one
piece per block and layer when block ids are not contiguous on both sides (as after the first
wave), and Mooncake TCP refuses a batch above 2,048 pieces: at 1,100 tokens (35 blocks) that is
2,240 pieces and every request of the wave fails (seen in the first run). 32 blocks is 2,048.
"""
SMALL = Shape("small", requests=8, layers=4, kv_heads=2, head_dim=32, tokens=1100)
"""The issue's small shape: 8 requests x 4 layers x 2 KV heads x 32 (same prompts: 1.1 MiB each)."""
QUICK = Shape("quick", requests=2, layers=2, kv_heads=2, head_dim=16, tokens=70, waves=2)
"""A smoke run's shape (``--quick``)."""
