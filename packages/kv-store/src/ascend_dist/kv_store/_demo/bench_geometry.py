"""The ``pool-vllm`` bench's model shape and workload (no vLLM, no torch: the CLI lists the scenario without them).

Runs in: the ``ascend-dist bench`` process.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FULL", "QUICK", "TAIL_TOKENS", "Geometry"]

TAIL_TOKENS = 5  # past the last whole chunk: the hit covers every whole chunk, vLLM computes the tail


@dataclass(frozen=True)
class Geometry:
    """The model's KV shape and the workload: ``requests`` prompts of ``chunks`` whole blocks each."""

    layers: int
    kv_heads: int
    head_dim: int
    block: int
    chunks: int
    requests: int

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{i}.self_attn.attn" for i in range(self.layers)]

    @property
    def chunk_bytes(self) -> int:
        """One block of every layer, K and V (float16): one pool object of either connector."""
        return self.layers * self.block * self.kv_heads * 2 * self.head_dim * 2

    @property
    def prompt_tokens(self) -> int:
        return self.chunks * self.block + TAIL_TOKENS

    @property
    def blocks_per_request(self) -> int:
        return -(-(self.prompt_tokens + 1) // self.block)

    @property
    def num_blocks(self) -> int:
        """Room for every request of one round at once (no block is reused within a round), plus vLLM's null block."""
        return self.requests * self.blocks_per_request + 2

    @property
    def round_bytes(self) -> int:
        """Bytes one round stores (and loads): every whole chunk of every prompt."""
        return self.requests * self.chunks * self.chunk_bytes


FULL = Geometry(layers=16, kv_heads=8, head_dim=128, block=32, chunks=16, requests=8)
"""The issue's shape: 2 MiB chunks; 8 prompts of 16 chunks = 256 MiB stored and loaded per round."""
QUICK = Geometry(layers=2, kv_heads=2, head_dim=16, block=16, chunks=4, requests=2)
"""A smoke run's shape (``--quick``)."""
