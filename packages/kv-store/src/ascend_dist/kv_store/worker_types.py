"""Small types shared by the worker and its layer-wise transfers.

Runs in: worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["ComputeEvent", "WorkerStats"]


class ComputeEvent(Protocol):
    """A device event recorded after the forward pass (``ascend_dist.common.device`` events qualify)."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the recorded work finished.

        Raises:
            DeadlineExceeded: Not finished within ``timeout``.
        """
        ...


@dataclass
class WorkerStats:
    """Counters for tests, the demo and the benchmark."""

    loaded_keys: int = 0
    loaded_bytes: int = 0
    failed_keys: int = 0
    saved_keys: int = 0
    saved_bytes: int = 0
    skipped_existing: int = 0
