"""Address alignment helpers for memory that is registered with a transfer engine.

Runs in: worker processes, at KV-cache registration. No torch import: tensors are only used through
their methods (`data_ptr`, `element_size`, ...), so this module is importable anywhere.

Ascend registration wants 2 MiB-aligned start addresses. The runner over-allocates every raw KV
allocation by the alignment and slices it; `align_memory` is the slicing step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ascend_dist.common.errors import ConfigError, RegionError

if TYPE_CHECKING:
    import torch

__all__ = ["REGISTRATION_ALIGNMENT", "align_memory", "align_up", "is_power_of_two"]

# Ascend's registration alignment (also the over-allocation the runner adds to each KV allocation).
REGISTRATION_ALIGNMENT = 2 << 20


def is_power_of_two(value: int) -> bool:
    """Return True when `value` is a positive integer power of two (1, 2, 4, ...)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and value & (value - 1) == 0


def align_up(value: int, alignment: int) -> int:
    """Round `value` up to the next multiple of `alignment`.

    Args:
        value: a non-negative integer (an address or a size in bytes).
        alignment: a power of two greater than zero.

    Returns:
        The smallest multiple of `alignment` that is ``>= value``.

    Raises:
        ConfigError: `alignment` is not a positive power of two, or `value` is negative.
    """
    if not is_power_of_two(alignment):
        raise ConfigError("alignment", alignment, "a power of two greater than 0")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError("value", value, "a non-negative integer")
    return (value + alignment - 1) & ~(alignment - 1)


def align_memory(tensor: torch.Tensor, alignment: int) -> torch.Tensor:
    """Return the suffix of `tensor` whose data pointer is rounded up to `alignment`.

    The tensor is viewed flat (it must be contiguous) and the first ``(aligned - ptr) / element_size``
    elements are skipped. The result aliases the input's memory (no copy).

    Args:
        tensor: a contiguous tensor, typically a raw over-allocated byte buffer.
        alignment: a power of two greater than zero, e.g. `REGISTRATION_ALIGNMENT`.

    Returns:
        A 1-D view starting at the first aligned address inside `tensor`.

    Raises:
        ConfigError: `alignment` is not a power of two, `tensor` is not contiguous, or the aligned
            address does not fall on an element boundary.
        RegionError: `tensor` is too small to hold one element at an aligned address.
    """
    ptr = tensor.data_ptr()
    aligned = align_up(ptr, alignment)
    if not tensor.is_contiguous():
        raise ConfigError("tensor", f"<strided tensor {tuple(tensor.shape)}>", "a contiguous tensor")
    elt = tensor.element_size()
    skip_bytes = aligned - ptr
    if skip_bytes % elt:
        raise ConfigError("alignment", alignment, f"a multiple of the element size ({elt} B) from address {ptr:#x}")
    flat = tensor.reshape(-1)
    skip = skip_bytes // elt
    if skip >= flat.numel():
        raise RegionError(
            "tensor",
            f"<{flat.numel() * elt} B at {ptr:#x}>",
            f"room for one element at the next {alignment}-byte boundary ({aligned:#x})",
        )
    return flat[skip:]
