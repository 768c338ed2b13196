"""Load-failure recording: failed block ids and failed requests, drained once per step.

Runs in: worker processes (written by the load path and the async receiving thread, read by the
connector once per step). Every KV group is recorded: upstream only logged failures of hybrid
models, so they could run on stale KV.

Two views of one failure, because vLLM 0.33 takes them on different paths:

* **block ids** (``get_block_ids_with_load_errors``): with one KV group vLLM recomputes from the
  earliest failed block. Block ids repeat across groups, so vLLM refuses (raises RuntimeError)
  block-level reports for a model with several groups;
* **request ids** (``get_transfer_results(...).failed_recving``): an async load that failed, reported
  together with the request in ``finished_recving``; vLLM then recomputes the whole request. This
  is the only report vLLM takes for a model with several groups.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

__all__ = ["LoadErrorRecorder"]

logger = logging.getLogger(__name__)


class LoadErrorRecorder:
    """Thread-safe sets of failed block ids and failed request ids."""

    def __init__(self) -> None:
        """Create an empty recorder."""
        self._blocks: set[int] = set()
        self._requests: set[str] = set()
        self._lock = threading.Lock()
        self.total_failed_blocks = 0
        self.total_failed_requests = 0

    def record(self, req_id: str, block_ids: Iterable[int], reason: str) -> None:
        """Record failed blocks of ``req_id`` (logged at WARNING with the reason).

        A call without a valid block id (all negative) records nothing: no KV was to be loaded.
        """
        ids = {b for b in block_ids if b >= 0}
        if not ids:
            return
        with self._lock:
            self._blocks |= ids
            self.total_failed_blocks += len(ids)
            if req_id not in self._requests:
                self._requests.add(req_id)
                self.total_failed_requests += 1
        logger.warning(
            "req=%s: %d block(s) failed to load from the pool (%s); vLLM recomputes them", req_id, len(ids), reason
        )

    def take(self) -> set[int]:
        """Return the failed block ids recorded since the last call, and forget them."""
        with self._lock:
            out, self._blocks = self._blocks, set()
        return out

    def pending_blocks(self) -> frozenset[int]:
        """Failed block ids recorded and not yet taken: blocks whose load failed in this step.

        A save of this step must not read them: they hold no chunk (vLLM recomputes them), yet a
        request hitting such a block from vLLM's prefix cache plans a save from it.
        """
        with self._lock:
            return frozenset(self._blocks)

    def take_failed_requests(self, req_ids: Iterable[str]) -> set[str]:
        """Those of ``req_ids`` whose load failed; they are forgotten."""
        with self._lock:
            out = self._requests.intersection(req_ids)
            self._requests -= out
        return out

    def retain_requests(self, req_ids: Iterable[str]) -> None:
        """Forget every failed request except ``req_ids`` (loads still to be reported)."""
        with self._lock:
            self._requests.intersection_update(req_ids)

    @property
    def failed_request_ids(self) -> frozenset[str]:
        """Failed requests recorded and not yet taken or dropped."""
        with self._lock:
            return frozenset(self._requests)
