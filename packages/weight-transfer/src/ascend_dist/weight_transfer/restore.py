"""A host copy of a model's tensors, taken before an update is loaded, to put the previous weights back.

Runs in: inference-worker processes (imports torch only).

vLLM's loaders write parameter by parameter, and its layer-wise reload first swaps a layer's
tensors for meta placeholders; a loader that raises half-way therefore leaves some new weights and
some old ones, or layers on the meta device. `ModuleSnapshot` records, for every module, which
tensor objects it holds (so placeholders can be swapped back for the original objects, whose
storage kernels and captured graphs point at) and a host copy of each distinct tensor (a tied
tensor is copied once). `restore` puts both back. The cost is one copy of the model in host memory
and one device-to-host copy per update, held only while the update loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["ModuleSnapshot"]


class ModuleSnapshot:
    """The tensors of ``module`` and its submodules, as objects and as host copies."""

    def __init__(self, module: torch.nn.Module) -> None:
        """Copy every parameter and buffer to host memory and record which module holds which object."""
        self._held = [
            (m, dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set)) for m in module.modules()
        ]
        copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for _, params, buffers, _ in self._held:
            for tensor in (*params.values(), *buffers.values()):
                if tensor is not None and id(tensor) not in copies and not tensor.is_meta:
                    copies[id(tensor)] = (tensor, tensor.detach().to("cpu", copy=True))
        self._copies = list(copies.values())
        self.nbytes = sum(host.nbytes for _, host in self._copies)

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
            for tensor, host in self._copies:
                tensor.data.copy_(host)
