"""Host capacity, computed once and shared by scheduler and worker.

Runs in: the scheduler and worker processes (pure integer math; no torch, no I/O).

Upstream computes the simple connector's host block count twice (scheduler from KV-config tensor
sizes, worker from actual row strides) and the two can disagree, letting the scheduler hand out
host ids past the worker's allocation. Here the scheduler's formula is the only one; the worker is
given its result and checks that its allocation holds at least that many blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.units import parse_byte_size
from ascend_dist.kv_offload.memory import align_up

__all__ = [
    "DEFAULT_ALIGNMENT",
    "HostCapacity",
    "NativeCapacity",
    "check_worker_capacity",
    "native_capacity",
    "normalise_legacy_native_config",
    "per_rank_capacity",
]

DEFAULT_ALIGNMENT = 4096
"""Host chunk alignment: the OS page size (65536 on 64K-page aarch64 kernels)."""

DEFAULT_CPU_BYTES = 8 << 30
"""``cpu_bytes_to_use`` default of the simple and recompute connectors (8 GiB)."""


def _positive(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "a positive integer")
    return value


@dataclass(frozen=True)
class NativeCapacity:
    """Host sizing of the native offloading tier.

    Attributes:
        chunk_bytes: bytes of one chunk over all workers, before alignment.
        aligned_chunk_bytes: ``chunk_bytes`` rounded up to the alignment.
        num_chunks: host chunks that fit in ``cpu_bytes_to_use``.
    """

    chunk_bytes: int
    aligned_chunk_bytes: int
    num_chunks: int


def native_capacity(
    cpu_bytes_to_use: int,
    worker_kv_bytes_per_block: int,
    world_size: int,
    blocks_per_chunk: int = 1,
    alignment: int = DEFAULT_ALIGNMENT,
) -> NativeCapacity:
    """``num_chunks = cpu_bytes // round_up(worker_bytes * world * k, alignment)``.

    Example: 64 B/block, world 2, k 2 -> chunk 256 B, aligned 4096; 40960 B -> 10 chunks.

    Raises:
        ConfigError: a non-positive input (naming the key).
    """
    _positive("cpu_bytes_to_use", cpu_bytes_to_use)
    chunk = (
        _positive("worker_kv_bytes_per_block", worker_kv_bytes_per_block)
        * _positive("world_size", world_size)
        * _positive("blocks_per_chunk", blocks_per_chunk)
    )
    aligned = align_up(chunk, _positive("alignment", alignment))
    return NativeCapacity(chunk, aligned, cpu_bytes_to_use // aligned)


def normalise_legacy_native_config(
    extra_config: Mapping[str, Any],
    worker_kv_bytes_per_block: int,
    world_size: int,
    blocks_per_chunk: int = 1,
    alignment: int = DEFAULT_ALIGNMENT,
) -> tuple[dict[str, Any], int | None]:
    """Translate legacy ``num_cpu_blocks`` into ``cpu_bytes_to_use`` in a *copy* of the config.

    ``cpu_bytes_to_use`` wins when both are set. On the scheduler side the worker byte size may be
    unknown (``<= 0``): the copy then carries a 1-byte placeholder and the second return value is
    the block count to force back afterwards.

    Returns:
        ``(new_config, forced_num_blocks or None)``; the caller's mapping is never mutated.

    Raises:
        ConfigError: ``num_cpu_blocks`` is not positive, or ``cpu_bytes_to_use`` has bad units.
    """
    config = dict(extra_config)
    if config.get("cpu_bytes_to_use"):
        config["cpu_bytes_to_use"] = parse_byte_size(config["cpu_bytes_to_use"], field="cpu_bytes_to_use")
        return config, None
    if "num_cpu_blocks" not in config:
        raise ConfigError("cpu_bytes_to_use", None, "a byte size (or legacy num_cpu_blocks > 0)")
    blocks = _positive("num_cpu_blocks", config["num_cpu_blocks"])
    if worker_kv_bytes_per_block <= 0:
        config["cpu_bytes_to_use"] = 1
        return config, blocks
    aligned = native_capacity(1, worker_kv_bytes_per_block, world_size, blocks_per_chunk, alignment).aligned_chunk_bytes
    config["cpu_bytes_to_use"] = blocks * aligned
    return config, None


def per_rank_capacity(extra_config: Mapping[str, Any], world_size: int) -> int:
    """Host bytes of one rank: ``cpu_bytes_to_use_per_rank``, else ``cpu_bytes_to_use // world_size``.

    Raises:
        ConfigError: bad units, a non-positive result or world size.
    """
    _positive("world_size", world_size)
    if extra_config.get("cpu_bytes_to_use_per_rank") is not None:
        value = parse_byte_size(extra_config["cpu_bytes_to_use_per_rank"], field="cpu_bytes_to_use_per_rank")
        return _positive("cpu_bytes_to_use_per_rank", value)
    total = parse_byte_size(extra_config.get("cpu_bytes_to_use", DEFAULT_CPU_BYTES), field="cpu_bytes_to_use")
    return _positive("cpu_bytes_to_use", total // world_size)


@dataclass(frozen=True)
class HostCapacity:
    """Host blocks of the simple and recompute connectors (one formula, used by both sides).

    Attributes:
        num_cpu_blocks: ``max(1, num_gpu_blocks * capacity_per_rank // total_device_kv_bytes)``.
        capacity_per_rank: host bytes of this rank.
        device_bytes_per_block: device KV bytes of one block over every tensor.
    """

    num_cpu_blocks: int
    capacity_per_rank: int
    device_bytes_per_block: int

    @classmethod
    def from_device(cls, num_gpu_blocks: int, total_device_kv_bytes: int, capacity_per_rank: int) -> HostCapacity:
        """Example: 2000 blocks, 40,000 MiB of KV, 16 GiB per rank -> 819 host blocks.

        Raises:
            ConfigError: a non-positive input.
        """
        blocks = _positive("num_gpu_blocks", num_gpu_blocks)
        total = _positive("total_device_kv_bytes", total_device_kv_bytes)
        per_rank = _positive("capacity_per_rank", capacity_per_rank)
        return cls(max(1, blocks * per_rank // total), per_rank, total // blocks)


def check_worker_capacity(allocated_blocks: int, capacity: HostCapacity) -> None:
    """Refuse a worker allocation smaller than the scheduler's block count.

    Raises:
        ConfigError: the worker holds fewer host blocks than the scheduler hands out.
    """
    if allocated_blocks < capacity.num_cpu_blocks:
        raise ConfigError(
            "num_cpu_blocks", allocated_blocks, f"at least the scheduler's {capacity.num_cpu_blocks} host blocks"
        )
