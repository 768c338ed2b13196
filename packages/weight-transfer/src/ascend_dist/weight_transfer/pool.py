"""Reusable byte buffers for the broadcast engine: pipeline slots (trainer) and staging (worker).

Runs in: trainer and inference-worker processes.

An update's buffers have the same sizes every time the model is the same, so they are allocated
once and kept between updates instead of per update. On a device, torch's caching allocator
already does this; on the CPU every large ``torch.empty`` is a fresh ``mmap`` whose pages are
faulted in (and zeroed by the kernel) on first write, which measured ~0.12 s per 267 MiB on the
development VM: as long as the wire itself. The price is that the worker's staging area (the size
of one update) stays resident between updates; `clear` (called by ``shutdown``) releases it.

A buffer handed out by `get` is reused by the next update: whoever reads views of it (a
`WeightSink`) must copy the bytes out before its ``load_weights`` returns, as the sink contract says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BufferPool"]


class BufferPool:
    """Named uint8 buffers kept between updates; a buffer is reallocated only when its size changes."""

    def __init__(self) -> None:
        """Start empty."""
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """The buffer ``key`` of exactly ``nbytes`` bytes on ``device`` (uninitialised when new).

        Args:
            key: Which buffer (``"slot0"``, ``"staging"``); each key holds one buffer.
            nbytes: Its size in bytes.
            device: Where it lives.

        Returns:
            A contiguous uint8 tensor; the same one as last time when size and device match.
        """
        import torch

        buf = self._buffers.get(key)
        if buf is None or buf.numel() != nbytes or buf.device != device:
            self._buffers.pop(key, None)  # free the old one before allocating the new one
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._buffers[key] = buf
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()
