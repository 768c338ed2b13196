"""Sparse KV offload: configuration and memory planning.

Runs in: the worker process at start-up (pure integer math; no torch, no I/O).

Sparse-attention MLA models keep the full main KV in a host pool and only the indexer caches plus a
small per-layer "hot buffer" on the device. `plan_sparse_memory` is the three-cap planner (device,
DRAM and active-demand limits; upstream PR #14921); `ratio_plan` is the older ratio method kept for
comparison; `hot_buffer_bytes` and `host_pool_layout` size the device buffers and the host pool.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ascend_dist.common.errors import ConfigError

__all__ = [
    "ALIGN_2MB",
    "SparseMemoryPlan",
    "SparseOffloadConfig",
    "host_pool_layout",
    "hot_buffer_bytes",
    "plan_sparse_memory",
    "ratio_plan",
]

logger = logging.getLogger(__name__)

ALIGN_2MB = 2 << 20
"""Host tensors start on 2 MiB boundaries; each host layer may waste up to 3 x 2 MiB."""

GIB = 1 << 30

Limit = Literal["npu", "dram", "workload"]


def _int(field: str, value: object, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(field, value, f"an integer >= {low}")
    return value


@dataclass(frozen=True)
class SparseOffloadConfig:
    """``additional_config.sparse_kv_offload_config``, validated against the model.

    Attributes:
        enabled: whether the feature is on.
        topk_buffer_size: hot-buffer slots per decode row.
        dram_size_per_dp_gb: host pool budget per DP rank, GiB.
        keep_device_kv_cache: debug mode keeping the device cache too.
        topk: the model's ``index_topk``.
    """

    enabled: bool
    topk_buffer_size: int
    dram_size_per_dp_gb: float
    keep_device_kv_cache: bool
    topk: int

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], *, index_topk: int | None, block_size: int, is_kv_consumer: bool = True
    ) -> SparseOffloadConfig:
        """Validate the raw config.

        Raises:
            ConfigError: the model lacks ``index_topk``; ``topk_buffer_size`` not positive, below
                ``index_topk`` or not a multiple of ``block_size``; a non-positive DRAM size; not a
                KV consumer without ``keep_device_kv_cache``. Each error names its key.
        """
        enabled = raw.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError("enabled", enabled, "true or false")
        keep = raw.get("keep_device_kv_cache", False)
        if not isinstance(keep, bool):
            raise ConfigError("keep_device_kv_cache", keep, "true or false")
        if index_topk is None:
            raise ConfigError("index_topk", None, "a model with a sparse indexer (index_topk set)")
        buffer = _int("topk_buffer_size", raw.get("topk_buffer_size", 4096), 1)
        if buffer < index_topk:
            raise ConfigError("topk_buffer_size", buffer, f">= index_topk ({index_topk}); start with 2 x index_topk")
        if buffer % block_size:
            raise ConfigError("topk_buffer_size", buffer, f"a multiple of block_size ({block_size})")
        dram = raw.get("dram_size_per_dp_GB", 128)
        if isinstance(dram, bool) or not isinstance(dram, int | float) or dram <= 0:
            raise ConfigError("dram_size_per_dp_GB", dram, "a positive number of GiB")
        if enabled and not is_kv_consumer and not keep:
            raise ConfigError("kv_role", "not a consumer", "a decode (kv_consumer) instance, or keep_device_kv_cache")
        return cls(enabled, buffer, float(dram), keep, index_topk)

    @property
    def dram_bytes(self) -> int:
        """The DRAM budget in bytes."""
        return int(self.dram_size_per_dp_gb * GIB)


@dataclass(frozen=True)
class SparseMemoryPlan:
    """Output of the three-cap planner.

    Attributes:
        num_blocks: blocks the engine gets.
        limit: which cap decided it (``npu``, ``dram`` or ``workload``).
        npu_limit / dram_limit / workload_limit: the three caps.
        host_bytes: ``num_blocks * H`` (main KV in the host pool).
        device_bytes: ``num_blocks * D`` (``H + D`` with the device cache kept).
        planner_bytes: ``num_blocks * (H + D)``, what vLLM is told.
        host_pool_bytes: what the host pool allocates, ``host_bytes + reserve``.
        reserve: alignment reserve, ``host layers * 3 * 2 MiB``.
    """

    num_blocks: int
    limit: Limit
    npu_limit: int
    dram_limit: int
    workload_limit: int
    host_bytes: int
    device_bytes: int
    planner_bytes: int
    host_pool_bytes: int
    reserve: int


def plan_sparse_memory(
    *,
    host_page_bytes: int,
    device_page_bytes: int,
    num_host_layers: int,
    available_device_bytes: int,
    dram_bytes: int,
    max_blocks_per_request: int,
    max_num_seqs: int,
    keep_device_kv_cache: bool = False,
) -> SparseMemoryPlan:
    """Bound the block count by device memory, DRAM and active demand.

    Example (DeepSeek-V3.2-like, 61 layers, block 128): ``H = 8,994,816``, ``D = 1,998,848``,
    20 GiB device, 128 GiB DRAM, 1024 blocks per request, 16 seqs -> npu 10,743, dram 15,237,
    workload 16,385: 10,743 blocks, limited by "npu".

    Raises:
        ConfigError: a non-positive page size; the host pool would exceed the DRAM budget.
    """
    h = _int("host_page_bytes", host_page_bytes, 1)
    d = _int("device_page_bytes", device_page_bytes, 1)
    reserve = _int("num_host_layers", num_host_layers, 0) * 3 * ALIGN_2MB
    per_device_block = h + d if keep_device_kv_cache else d
    npu = max(available_device_bytes, 0) // per_device_block
    dram = max(dram_bytes - reserve, 0) // h
    workload = max(max_blocks_per_request, 0) * max(max_num_seqs, 0) + 1
    caps: dict[Limit, int] = {"npu": npu, "dram": dram, "workload": workload}
    limit: Limit = min(caps, key=lambda name: caps[name])
    final = caps[limit]
    if dram < npu:
        logger.warning(
            "sparse offload: DRAM caps blocks at %d below the device's %d: raise dram_size_per_dp_GB", dram, npu
        )
    pool = final * h + reserve
    if pool > dram_bytes and final > 0:
        raise ConfigError("dram_size_per_dp_GB", dram_bytes / GIB, f">= {pool / GIB:.2f} GiB for {final} blocks")
    return SparseMemoryPlan(
        final, limit, npu, dram, workload, final * h, final * per_device_block, final * (h + d), pool, reserve
    )


def ratio_plan(
    host_page_bytes: int,
    device_page_bytes: int,
    available_device_bytes: int,
    dram_gb: float,
    *,
    keep_device: bool = False,
) -> tuple[float, int, int]:
    """The older ratio method: ``(ratio, reported available bytes, blocks)``.

    ``ratio = H / D`` (0 without host layers); DRAM needed ``ratio * A`` (``A`` when the device
    cache is kept) must fit ``dram_gb`` GiB; vLLM is told ``A + ratio * A``, so it gets ``A // D``
    blocks.

    Raises:
        ConfigError: the DRAM needed exceeds the budget, or a non-positive device page.
    """
    d = _int("device_page_bytes", device_page_bytes, 1)
    ratio = host_page_bytes / d
    needed = available_device_bytes if keep_device else ratio * available_device_bytes
    if needed > dram_gb * GIB:
        raise ConfigError("dram_size_per_dp_GB", dram_gb, f">= {needed / GIB:.1f} GiB needed by the ratio method")
    reported = available_device_bytes if keep_device else int(available_device_bytes + ratio * available_device_bytes)
    return ratio, reported, available_device_bytes // d


def hot_buffer_bytes(
    *, max_num_batched_tokens: int, max_num_seqs: int, num_spec_tokens: int, topk_buffer_size: int,
    kv_lora_rank: int, rope_dim: int, element_size: int = 2,
) -> tuple[int, int, int]:  # fmt: skip
    """``(rows, K bytes, V bytes)`` of one layer's hot buffer pair.

    ``rows = min(max_num_batched_tokens, max_num_seqs * (1 + num_spec_tokens))``. Example: 16 seqs,
    MTP 1, 4096 slots, DeepSeek dims -> 32 rows, K 128 MiB, V 16 MiB.
    """
    rows = min(max_num_batched_tokens, max_num_seqs * (1 + num_spec_tokens))
    per_slot = topk_buffer_size * element_size
    return rows, rows * per_slot * kv_lora_rank, rows * per_slot * rope_dim


def host_pool_layout(sizes: Sequence[int], align: int = ALIGN_2MB) -> tuple[int, list[int]]:
    """``(raw bytes to allocate, offset of each tensor from the aligned base)``.

    Raw size ``(1 + sum(ceil(size / align))) * align`` leaves room to round the raw base up; tensors
    sit at consecutive aligned offsets, so K->V and layer->layer deltas are uniform.
    """
    offsets: list[int] = []
    pos = 0
    for size in sizes:
        offsets.append(pos)
        pos += math.ceil(_int("size", size, 0) / align) * align
    return (1 + sum(math.ceil(s / align) for s in sizes)) * align, offsets
