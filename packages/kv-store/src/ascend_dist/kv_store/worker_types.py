"""Small types shared by the worker and its layer-wise transfers.

Runs in: worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["ComputeEvent", "LayerwiseOptions", "WorkerStats"]


class ComputeEvent(Protocol):
    """A device event recorded after the forward pass (``ascend_dist.common.device`` events qualify)."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the recorded work finished.

        Raises:
            DeadlineExceeded: Not finished within ``timeout``.
        """
        ...


@dataclass
class WorkerStats:
    """Counters for tests, the demo and the benchmark."""

    loaded_keys: int = 0
    loaded_bytes: int = 0
    failed_keys: int = 0
    saved_keys: int = 0
    saved_bytes: int = 0
    skipped_existing: int = 0


@dataclass(frozen=True)
class LayerwiseOptions:
    """Layer-wise transfer settings (``layerwise_*`` and ``h2d_stagger_us`` of the extra config).

    ``prefetch_layers`` and ``attention_gate`` apply to both layer-wise flavours; the rest only to
    the GVA one (memcache: one object per block).
    """

    prefetch_layers: int = 1
    attention_gate: bool = False  # wait for the attention-start gate (something must record it)
    tp_size: int = 1
    max_transfer_blocks: int = 0
    max_transfer_bytes: int = 0
    h2d_stagger_us: int = 0
    num_shared_buffers: int = 0  # 0 = a buffer per layer; fewer than the reused layers is refused (no reuse yet)
    independent_layers: tuple[int, ...] | str = (0,)
