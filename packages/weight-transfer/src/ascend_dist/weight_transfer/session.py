"""The worker's weight-update lifecycle as an explicit state machine, and the weight sinks.

Runs in: inference-worker processes.

States and transitions (anything else raises `UpdateStateError` naming the call and the state):

    NEW --init--> READY --start--> ACTIVE --update--> ACTIVE --finish--> READY
    ACTIVE --update fails--> READY      (the session can start over)
    any --shutdown--> CLOSED
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final, Protocol, runtime_checkable

from ascend_dist.common.device.ipc import dtype_to_str
from ascend_dist.weight_transfer.errors import ManifestMismatch, UpdateStateError

if TYPE_CHECKING:
    import torch

    from ascend_dist.weight_transfer.messages import Manifest

__all__ = ["ModuleSink", "RestorableSink", "Session", "SessionState", "Snapshot", "WeightSink"]

logger = logging.getLogger(__name__)


class SessionState(enum.Enum):
    """Where a worker's transfer session is."""

    NEW = "new"
    READY = "ready"
    ACTIVE = "active"
    CLOSED = "closed"


_HINTS: Final[Mapping[tuple[str, SessionState], str]] = {
    ("start", SessionState.ACTIVE): "an update is already active; call finish_weight_update first",
    ("update", SessionState.READY): "no update is active; call start_weight_update first",
    ("finish", SessionState.READY): "no update is active; call start_weight_update first",
}
_ALLOWED: Final[Mapping[str, frozenset[SessionState]]] = {
    "init": frozenset({SessionState.NEW, SessionState.READY}),
    "start": frozenset({SessionState.READY}),
    "update": frozenset({SessionState.ACTIVE}),
    "finish": frozenset({SessionState.ACTIVE}),
}


class Session:
    """The lifecycle of one worker engine; every public engine call goes through `require`."""

    def __init__(self, name: str) -> None:
        """Start in NEW; ``name`` identifies the engine in errors."""
        self.name = name
        self.state = SessionState.NEW

    def require(self, op: str) -> None:
        """Raise `UpdateStateError` unless ``op`` is allowed in the current state."""
        if self.state in _ALLOWED[op]:
            return
        hint = _HINTS.get((op, self.state))
        if hint is None:
            hint = "call init_transfer_engine first" if self.state is SessionState.NEW else "the engine is shut down"
        raise UpdateStateError(f"{self.name}: {op} in state {self.state.value}: {hint}")

    def move(self, state: SessionState) -> None:
        """Enter ``state`` (after `require` passed and the operation succeeded)."""
        logger.debug("%s: %s -> %s", self.name, self.state.value, state.value)
        self.state = state


@runtime_checkable
class WeightSink(Protocol):
    """Where received weights go: vLLM models and `ModuleSink` both have ``load_weights``."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        """Copy each ``(name, tensor)`` into the model."""
        ...


class Snapshot(Protocol):
    """A restore point of a model, taken before an update is loaded (`restore.ModuleSnapshot`)."""

    def restore(self) -> None:
        """Put the model's previous tensors and values back."""
        ...


@runtime_checkable
class RestorableSink(WeightSink, Protocol):
    """A sink that can take a restore point before a staged update is loaded."""

    def snapshot(self) -> Snapshot | None:
        """A restore point of the model now, or None when restoring is turned off."""
        ...


class ModuleSink:
    """A `WeightSink` over a plain ``torch.nn.Module``: copies by parameter name, validated first.

    `validate` checks a whole manifest against the module before any byte is written, so an unknown
    name or a shape/dtype mismatch is refused while the module still holds its previous weights.
    """

    def __init__(self, module: torch.nn.Module, *, restore: bool = True) -> None:
        """Sink into ``module``'s named parameters and buffers.

        Args:
            module: The model.
            restore: Take a host restore point before each staged update loads (see `snapshot`).
        """
        from ascend_dist.weight_transfer.pool import BufferPool

        self.module = module
        self.restore = restore
        self._restore_pool = BufferPool()  # the host restore point's bytes, kept between updates
        self._targets: dict[str, torch.Tensor] = dict(module.named_parameters())
        self._targets.update(dict(module.named_buffers()))

    def validate(self, manifest: Manifest) -> None:
        """Raise `ManifestMismatch` naming the first tensor the module cannot take."""
        for spec in manifest.tensors:
            target = self._targets.get(spec.name)
            if target is None:
                raise ManifestMismatch(f"unknown parameter {spec.name!r}: the model has no such name")
            if tuple(target.shape) != spec.shape:
                raise ManifestMismatch(
                    f"shape of {spec.name!r}: model has {tuple(target.shape)}, update has {spec.shape}"
                )
            if dtype_to_str(target.dtype) != spec.dtype:
                raise ManifestMismatch(
                    f"dtype of {spec.name!r}: model has {dtype_to_str(target.dtype)}, update has {spec.dtype}"
                )

    def snapshot(self) -> Snapshot | None:
        """A host copy of the module, restored when a load fails on any rank (valid until the next one).

        None when ``restore`` is off: a failed load then leaves mixed weights (`LoadFailed`).
        """
        from ascend_dist.weight_transfer.restore import ModuleSnapshot

        return ModuleSnapshot(self.module, self._restore_pool) if self.restore else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each tensor into the parameter of that name; returns the names loaded."""
        import torch

        from ascend_dist.weight_transfer.packing import as_bytes, copy_bytes

        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = self._targets.get(name)
                if target is None:
                    raise ManifestMismatch(f"unknown parameter {name!r}: the model has no such name")
                same = target.dtype == tensor.dtype and target.shape == tensor.shape and target.is_contiguous()
                if same and target.numel():
                    copy_bytes(target.view(-1).view(torch.uint8), as_bytes(tensor))
                else:
                    target.copy_(tensor)
                loaded.add(name)
        return loaded
