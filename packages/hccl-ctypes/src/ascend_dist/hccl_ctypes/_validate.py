"""Argument checks of `PyHcclCommunicator`, done before anything is enqueued.

Runs in: worker processes (imports torch).
"""

from __future__ import annotations

import torch

from ascend_dist.common.errors import ConfigError
from ascend_dist.hccl_ctypes.dialects import Dialect
from ascend_dist.hccl_ctypes.torch_compat import dtype_code

__all__ = ["check_peer", "check_tensor", "check_same"]


def check_tensor(field: str, tensor: torch.Tensor, dialect: Dialect, device: torch.device) -> None:
    """A tensor the library can take: a supported dtype, on ``device``, contiguous.

    Raises:
        ConfigError: Not a tensor, on another device, or non-contiguous (names ``field``).
        UnsupportedDtype: Its dtype has no code in ``dialect``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(field, type(tensor).__name__, "a torch.Tensor")
    dtype_code(dialect, tensor.dtype)
    if tensor.device != device:
        raise ConfigError(f"{field}.device", str(tensor.device), f"{device} (the communicator's device)")
    if not tensor.is_contiguous():
        raise ConfigError(field, f"a non-contiguous tensor of shape {tuple(tensor.shape)}", "a contiguous tensor")


def check_same(field: str, out: torch.Tensor, dtype: torch.dtype, numel: int) -> None:
    """``out`` has ``dtype`` and ``numel`` elements.

    Raises:
        ConfigError: Otherwise, naming both.
    """
    if out.dtype != dtype or out.numel() != numel:
        raise ConfigError(field, f"{out.dtype}[{out.numel()}]", f"{dtype}[{numel}]")


def check_peer(field: str, peer: int, world_size: int, *, not_rank: int | None = None) -> int:
    """A group rank in ``[0, world_size)`` (and not ``not_rank``, for point-to-point).

    Raises:
        ConfigError: Otherwise.
    """
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world_size:
        raise ConfigError(field, peer, f"a rank in [0, {world_size})")
    if peer == not_rank:
        raise ConfigError(field, peer, f"a rank other than this one ({not_rank})")
    return peer
