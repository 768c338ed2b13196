"""A synthetic split K/V cache laid out as Ascend allocates it, for the integration tests.

Each layer is one raw allocation over-allocated by the 2 MiB registration alignment and sliced, so
the tensors start at a non-zero storage offset, and K and V are separate tensors in it (not one
[2, blocks, ...] tensor). Registration goes through the merged regions of ascend_dist.common.
"""

from __future__ import annotations

import torch

from ascend_dist.common.regions import (
    RegisterRegions,
    collect_storage_merged_register_regions,
    validate_register_region_count,
)
from ascend_dist.kv_offload.memory import REGISTRATION_ALIGNMENT, align_memory


class SplitKVCache:
    """`layers` x (K, V), each `[blocks, block_bytes]` int8, one raw allocation per layer."""

    def __init__(self, layers: int, blocks: int, block_bytes: int) -> None:
        self.blocks = blocks
        self.block_bytes = block_bytes
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        per_tensor = blocks * block_bytes
        for _ in range(layers):
            raw = torch.zeros(2 * per_tensor + REGISTRATION_ALIGNMENT + 1, dtype=torch.int8)
            aligned = align_memory(raw[1:], REGISTRATION_ALIGNMENT)
            k = aligned[:per_tensor].view(blocks, block_bytes)
            v = aligned[per_tensor : 2 * per_tensor].view(blocks, block_bytes)
            self.layers.append((k, v))

    def tensors(self) -> list[torch.Tensor]:
        return [t for kv in self.layers for t in kv]

    def bases(self) -> list[int]:
        return [t.data_ptr() for t in self.tensors()]

    def fill(self, seed: int) -> None:
        """Deterministic content the other process can regenerate to check what it received."""
        for i, t in enumerate(self.tensors()):
            t.copy_(self.expected(seed, i))

    def expected(self, seed: int, tensor_index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1000 + tensor_index)
        return torch.randint(-128, 128, (self.blocks, self.block_bytes), dtype=torch.int8, generator=gen)

    def register(self, engine: object) -> RegisterRegions:
        regions = collect_storage_merged_register_regions(self.layers)
        validate_register_region_count(regions)
        rc = engine.batch_register_memory(list(regions.ptrs), list(regions.lengths))  # type: ignore[attr-defined]
        if rc != 0:
            raise RuntimeError(f"batch_register_memory returned {rc}")
        return regions

    def unregister(self, engine: object, regions: RegisterRegions) -> None:
        engine.batch_unregister_memory(list(regions.ptrs))  # type: ignore[attr-defined]
