"""Reusable byte buffers for the broadcast engine: pipeline slots (trainer) and staging (worker).

Runs in: trainer and inference-worker processes.

An update's buffers have the same sizes every time the model is the same, so the staged (all or
nothing) mode allocates them once and keeps them between updates instead of per update. On a
device, torch's caching allocator already does this; on the CPU every large ``torch.empty`` is a
fresh ``mmap`` whose pages are faulted in (and zeroed by the kernel) on first write, which measured
~0.12 s per 267 MiB on the development VM: as long as the wire itself. The price is that the
worker's staging area (the size of one update) stays resident between updates; `clear` (called by
``shutdown``) releases it. Streamed updates keep their ``num_buffers`` bucket buffers (of at most
``buffer_size_bytes``) here too, for the same reason: a fresh pair per update cost 50-300 ms of
first-touch faults per update on the development VM, as much as the whole wire. At most the bound
is held, during an update and between updates.

Buffers come from the device runtime's allocator where the runtime owns the device (`device_allocator`),
so the CPU simulation counts them (`CpuSimRuntime.peak_allocated_bytes`): the bench and tests
measure the staging peak there instead of trusting this module's arithmetic.

A buffer handed out by `get` is reused by the next update: whoever reads views of it (a
`WeightSink`) must copy the bytes out before its ``load_weights`` returns, as the sink contract says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Allocate", "BufferPool", "device_allocator"]

Allocate = Callable[[int, "torch.device"], "torch.Tensor"]
"""``(nbytes, device) -> uint8 tensor`` of exactly ``nbytes`` on ``device``."""


def _torch_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def device_allocator(nbytes: int, device: torch.device) -> torch.Tensor:
    """Allocate through this process's device runtime when it owns ``device``, else plain torch.

    The runtime of ``device`` allocates on it (and the CPU simulation counts what it allocates);
    a ``cpu`` device under a hardware backend (gloo next to an NPU) is host memory: plain torch.
    """
    import torch

    from ascend_dist.common.device import get_runtime

    runtime = get_runtime(None if device.type == "cpu" else device)
    if runtime.name != device.type:
        return _torch_empty(nbytes, device)
    return runtime.empty((nbytes,), torch.uint8)


class BufferPool:
    """Named uint8 buffers kept between updates; a buffer is reallocated only when its size changes."""

    def __init__(self, allocate: Allocate = _torch_empty) -> None:
        """Start empty; new buffers come from ``allocate`` (`device_allocator` in the engines)."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._allocate = allocate

    def get(self, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """The buffer ``key`` of exactly ``nbytes`` bytes on ``device`` (uninitialised when new).

        Args:
            key: Which buffer (``"slot0"``, ``"staging"``); each key holds one buffer.
            nbytes: Its size in bytes.
            device: Where it lives.

        Returns:
            A contiguous uint8 tensor; the same one as last time when size and device match.
        """
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != nbytes or buf.device != device:
            self._buffers.pop(key, None)  # free the old one before allocating the new one
            buf = self._allocate(nbytes, device)
            self._buffers[key] = buf
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()
