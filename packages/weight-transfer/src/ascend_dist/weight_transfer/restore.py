"""A host copy of a model's tensors, taken before an update is loaded, to put the previous weights back.

Runs in: inference-worker processes (imports torch only).

vLLM's loaders write parameter by parameter, and its layer-wise reload first swaps a layer's
tensors for meta placeholders; a loader that raises half-way therefore leaves some new weights and
some old ones, or layers on the meta device. `ModuleSnapshot` records, for every module, which
tensor objects it holds (so placeholders can be swapped back for the original objects, whose
storage kernels and captured graphs point at) and a host copy of each distinct tensor (a tied
tensor is copied once). `restore` puts both back. The cost is one device-to-host copy of the model
per update, into one host buffer the sink keeps between updates (``pool``): on the CPU a fresh copy
per update would fault in and zero every page first, which measured 0.15 s per 267 MiB on the
development VM, as much as the whole wire; kept, it is one plain memcpy. The buffer stays
resident (one host copy of the model per worker) until the engine shuts down.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ascend_dist.weight_transfer.packing import as_bytes, copy_bytes
from ascend_dist.weight_transfer.pool import BufferPool

if TYPE_CHECKING:
    import torch

__all__ = ["ModuleSnapshot"]

_ALIGN = 64


class ModuleSnapshot:
    """The tensors of ``module`` and its submodules, as objects and as host copies."""

    def __init__(self, module: torch.nn.Module, pool: BufferPool | None = None) -> None:
        """Copy every parameter and buffer to host memory and record which module holds which object.

        Args:
            module: The model.
            pool: Where the host bytes live: its ``"restore"`` buffer, reused by the next snapshot
                from the same pool (so a snapshot is valid only until the next one is taken).
                None: a fresh buffer for this snapshot alone.
        """
        import torch

        self._held = [
            (m, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set)) for m in module.modules()
        ]
        distinct: dict[int, torch.Tensor] = {}
        for _, params, buffers, _ in self._held:
            for tensor in (*params.values(), *buffers.values()):
                if tensor is not None and not tensor.is_meta:
                    distinct.setdefault(id(tensor), tensor)
        sources = [(tensor, as_bytes(tensor)) for tensor in distinct.values()]
        offsets, end = [], 0
        for _, image in sources:
            offsets.append(end)
            end += -(-image.numel() // _ALIGN) * _ALIGN  # every copy aligned, so it can be viewed as its dtype
        self.nbytes = sum(image.numel() for _, image in sources)
        host = (pool if pool is not None else BufferPool()).get("restore", end, torch.device("cpu"))
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for (tensor, image), offset in zip(sources, offsets, strict=True):
            saved = host[offset : offset + image.numel()]
            copy_bytes(saved, image)
            self._copies.append((tensor, saved))

    def restore(self) -> None:
        """Put the recorded tensor objects back on their modules and their recorded values into them."""
        import torch

        for module, params, buffers, non_persistent in self._held:
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
            module._non_persistent_buffers_set.clear()
            module._non_persistent_buffers_set.update(non_persistent)
        with torch.no_grad():
            for tensor, saved in self._copies:
                if tensor.is_contiguous():  # as_bytes is then a view of the tensor itself
                    copy_bytes(as_bytes(tensor), saved)
                else:  # the saved bytes are its row-major image
                    tensor.data.copy_(saved.view(tensor.dtype).view(tensor.shape))
