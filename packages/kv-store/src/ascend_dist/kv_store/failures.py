"""Load-failure recording for ``get_block_ids_with_load_errors``.

Runs in: worker processes (written by the load path and the async receiving thread, read by the
connector once per step). Every KV group is reported: upstream only logged failures of hybrid
models, so they could run on stale KV (spec §19.13). vLLM block ids are global across groups, so
one set holds them all; vLLM recomputes from the earliest failed block.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

__all__ = ["LoadErrorRecorder"]

logger = logging.getLogger(__name__)


class LoadErrorRecorder:
    """A thread-safe set of block ids whose load failed, drained once per step."""

    def __init__(self) -> None:
        """Create an empty recorder."""
        self._blocks: set[int] = set()
        self._lock = threading.Lock()
        self.total_failed_blocks = 0

    def record(self, req_id: str, block_ids: Iterable[int], reason: str) -> None:
        """Record failed blocks of ``req_id`` (logged at WARNING with the reason)."""
        ids = {b for b in block_ids if b >= 0}
        if not ids:
            return
        with self._lock:
            self._blocks |= ids
            self.total_failed_blocks += len(ids)
        logger.warning(
            "req=%s: %d block(s) failed to load from the pool (%s); vLLM recomputes them", req_id, len(ids), reason
        )

    def take(self) -> set[int]:
        """Return the failed block ids recorded since the last call, and forget them."""
        with self._lock:
            out, self._blocks = self._blocks, set()
        return out
