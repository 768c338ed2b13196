"""Layer-wise transfer settings, parsed by `config.config` and read by the layer-wise transfers.

Runs in: every process that parses the config. Moved out of `transfer/worker_types.py` so that `config/` imports
nothing above it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerwiseOptions"]


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
