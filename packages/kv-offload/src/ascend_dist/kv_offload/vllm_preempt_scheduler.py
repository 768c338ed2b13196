"""vLLM schedulers that let the connector save a request's KV before preempting it.

Runs in: the engine core (vLLM 0.32 and 0.33). `RecomputeCPUOffloadConnector` keeps a preempted
request's KV in host memory only when the scheduler asks it to, through
``update_state_before_preempt`` (the hook Ascend's RecomputeScheduler calls); vLLM's own schedulers
never do, so on them every preemption is recomputed. Select one of these with vLLM's
``scheduler_cls``:

- ``ascend_dist.kv_offload.vllm_preempt_scheduler.PreemptSavingScheduler`` (vLLM's `Scheduler`),
- ``ascend_dist.kv_offload.vllm_preempt_scheduler.AsyncPreemptSavingScheduler`` (with
  ``async_scheduling``).

Unlike Ascend's RecomputeScheduler, a request whose KV cannot be saved (no host room, a connector
without the hook) is preempted and recomputed locally as vLLM does, never handed back to the proxy.
Works with `AscendMultiConnector`, which asks each child that has the hook.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

__all__ = ["AsyncPreemptSavingScheduler", "PreemptSavingScheduler", "PreemptSavingMixin"]

logger = logging.getLogger(__name__)


class PreemptSavingMixin:
    """Ask the connector to save a request's KV before vLLM frees its blocks for a preemption.

    The connector records the save in the scheduler; its worker copies the blocks at the start of
    the next step, before that step's forward pass can overwrite the freed blocks.
    """

    connector: Any
    kv_cache_manager: Any

    def _save_before_preempt(self, request: Request) -> bool:
        """Whether the connector took the request's KV (False: vLLM recomputes it on resume)."""
        hook = getattr(self.connector, "update_state_before_preempt", None)
        if not callable(hook):
            return False
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        try:
            return bool(hook(request, block_ids, request.num_computed_tokens))
        except Exception:  # a failed save must not stop the scheduler: the request is recomputed
            logger.exception("saving the KV of preempted request %s failed; it will be recomputed", request.request_id)
            return False

    def _preempt_request(self, request: Request, timestamp: float, drop_stale_output: bool = False) -> None:
        # Logged as vLLM's v0 scheduler did: a preemption means the KV cache is too small for the load.
        if self._save_before_preempt(request):
            logger.warning(
                "request %s preempted (KV cache full): %d computed tokens saved to host memory, restored on resume",
                request.request_id, request.num_computed_tokens,
            )  # fmt: skip
        else:
            logger.warning(
                "request %s preempted (KV cache full): nothing saved, recomputed on resume", request.request_id
            )
        super()._preempt_request(request, timestamp, drop_stale_output)  # type: ignore[misc]


class PreemptSavingScheduler(PreemptSavingMixin, Scheduler):
    """vLLM's `Scheduler` that saves a preempted request's KV through the connector."""


class AsyncPreemptSavingScheduler(PreemptSavingMixin, AsyncScheduler):
    """vLLM's `AsyncScheduler` that saves a preempted request's KV through the connector."""
