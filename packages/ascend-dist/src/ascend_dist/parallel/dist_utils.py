"""Small distributed helpers used by the connectors: async all-gather and first-dimension splits.

Runs in: worker processes. `group` is anything shaped like vLLM's GroupCoordinator (world size, rank,
device group), so the helpers run over gloo in tests.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from ascend_dist.common.errors import ConfigError

__all__ = ["GroupLike", "all_gather_async", "split_tensor_along_first_dim"]


class GroupLike(Protocol):
    """The parts of a group coordinator these helpers read."""

    world_size: int
    rank_in_group: int
    device_group: Any


def all_gather_async(
    tensor: torch.Tensor, group: GroupLike, output: torch.Tensor | None = None, *, async_op: bool = True
) -> tuple[torch.Tensor, dist.Work | None]:
    """Gather `tensor` from every rank along dim 0.

    Returns:
        ``(output, work)``: with one rank, the input itself and None (any `output` given is ignored);
        otherwise the gathered tensor and the pending work (None when `async_op` is False). Call
        ``work.wait()`` before reading `output`.
    """
    if group.world_size == 1:
        return tensor, None
    shape = (tensor.shape[0] * group.world_size, *tensor.shape[1:])
    if output is None:
        output = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    elif tuple(output.shape) != shape:
        raise ConfigError("output.shape", tuple(output.shape), f"{shape}")
    work = dist.all_gather_into_tensor(output, tensor, group=group.device_group, async_op=async_op)
    return output, work


def split_tensor_along_first_dim(
    tensor: torch.Tensor, num_partitions: int, *, contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """Split dim 0 into `num_partitions` equal views (or contiguous copies if asked)."""
    if num_partitions < 1 or tensor.shape[0] % num_partitions:
        raise ConfigError("num_partitions", num_partitions, f"a positive divisor of {tensor.shape[0]}")
    chunks = torch.split(tensor, tensor.shape[0] // num_partitions, dim=0)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else chunks
