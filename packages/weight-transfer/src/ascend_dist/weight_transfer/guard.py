"""Refuse to run a model whose weights may be a mix of two updates.

Runs in: inference-worker processes (imports torch only).

A streamed update loads bucket by bucket, and a loader failure that cannot be undone leaves some
tensors new and some old; serving from such a model is silent wrong output. `WeightsGuard` is
tripped by the worker engines when that happens and cleared when a later complete update
succeeds. While tripped, every forward of the modules it is installed on raises
`WeightsInconsistent` naming the cause.

Hooks: a forward pre-hook on the model, and on each of its vLLM ``LogitsProcessor`` submodules,
because a device graph replay (CUDA / ACL graphs) runs the captured forward without calling the
model's Python hooks, while vLLM computes logits eagerly outside the graph on every step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ascend_dist.weight_transfer.errors import WeightsInconsistent

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

__all__ = ["WeightsGuard"]

logger = logging.getLogger(__name__)

_LOGITS_CLASS = "LogitsProcessor"  # vllm.model_executor.layers.logits_processor; matched by name: no vLLM import


class WeightsGuard:
    """A flag, set while the weights may be mixed, that makes guarded modules refuse to run."""

    def __init__(self) -> None:
        """Start cleared and installed on nothing."""
        self.reason: str | None = None
        self._handles: dict[int, list[RemovableHandle]] = {}

    @property
    def tripped(self) -> bool:
        """Whether guarded modules refuse to run."""
        return self.reason is not None

    def install(self, model: torch.nn.Module) -> None:
        """Guard ``model``'s forward and its logits processors (idempotent per model)."""
        if id(model) in self._handles:
            return
        targets = [model] + [m for m in model.modules() if m is not model and type(m).__name__ == _LOGITS_CLASS]
        self._handles[id(model)] = [m.register_forward_pre_hook(self._hook) for m in targets]

    def remove(self) -> None:
        """Take every hook off (the flag is kept)."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()

    def trip(self, reason: str) -> None:
        """Refuse every forward from now on, naming ``reason``, until `clear`."""
        self.reason = reason
        logger.error("weights may be mixed, refusing to run the model until a complete update succeeds: %s", reason)

    def clear(self) -> None:
        """A complete update succeeded: run again."""
        if self.reason is not None:
            logger.info("a complete update succeeded: the model runs again")
        self.reason = None

    def check(self) -> None:
        """Raise `WeightsInconsistent` while tripped."""
        if self.reason is not None:
            raise WeightsInconsistent(
                f"the model's weights may be mixed ({self.reason}); it refuses to run until a complete update "
                "succeeds: send one"
            )

    def _hook(self, module: torch.nn.Module, args: Any) -> None:  # torch's forward pre-hook signature
        self.check()
