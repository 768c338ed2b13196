"""Small types shared by the worker and its layer-wise transfers.

Runs in: worker processes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ascend_dist.common.transfer_stats import TransferStats

__all__ = ["ComputeEvent", "RemovableBackend", "WorkerStats", "WorkerWaits"]


class ComputeEvent(Protocol):
    """A device event recorded after the forward pass (``ascend_dist.common.device`` events qualify)."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the recorded work finished.

        Raises:
            DeadlineExceeded: Not finished within ``timeout``.
        """
        ...


@runtime_checkable
class RemovableBackend(Protocol):
    """A store client that can drop objects (what a cancelled save's in-flight put stored)."""

    def remove(self, keys: Sequence[str]) -> None:
        """Remove ``keys`` from the store; absent keys are ignored.

        Raises:
            StoreError: The store cannot be reached.
        """
        ...


@dataclass
class WorkerStats:
    """Counters for tests, the demo and the benchmark; ``transfer``: each store call, for vLLM's connector stats."""

    loaded_keys: int = 0
    loaded_bytes: int = 0
    failed_keys: int = 0
    saved_keys: int = 0
    saved_bytes: int = 0
    skipped_existing: int = 0
    cancelled_saves: int = 0  # request saves cancelled before reading (a preemption or hybrid deadline)
    dropped_keys: int = 0  # keys removed after an abandoned put (past the fence deadline) returned
    retried_keys: int = 0  # keys put again after their put failed
    unwritten_skipped: int = 0  # chunk saves skipped: their block failed to load this step (holds no chunk)
    # every get/put/GVA copy (`pool_stats.record_call`), taken by the connector at each vLLM poll
    # (`vllm_stats`); None: not recorded (nobody would take the rows: they would only accumulate)
    transfer: TransferStats | None = None


@dataclass(frozen=True)
class WorkerWaits:
    """Deadlines of a worker's waits, in seconds (tests shorten them)."""

    preempt_s: float = 30.0  # a preempted request's pending saves; past it they are cancelled
    compute_s: float = 60.0  # the forward pass's event before a save reads; a hybrid step's own saves
    step_load_s: float = 60.0  # layer-wise: one step's loads, all layers together; past it the step is fenced
    fence_s: float = 300.0  # a fenced step's get, or a cancelled save's put, in flight; past it DeadlineExceeded
