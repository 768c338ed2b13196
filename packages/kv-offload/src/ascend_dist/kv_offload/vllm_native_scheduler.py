"""vLLM adapter of native offloading, scheduler side: failed stores never become loadable.

Runs in: vLLM's scheduler process (the metadata class also in workers, which build it). Imports
vLLM (0.32 and 0.33: ``...kv_connector.v1.offloading``); part of the native adapter with `vllm_native`.

vLLM's ``OffloadingConnectorWorker`` asserts that every copy succeeded. Our worker side
(`vllm_native.AscendOffloadingConnectorWorker`) reports a failed store's job id in
`AscendOffloadingWorkerMetadata.failed_jobs`; `AscendOffloadingConnectorScheduler` then completes
that store with ``success=False`` once every worker reported it, so the manager drops the chunks
(a later lookup misses) instead of marking them stored.

With several KV-cache groups, vLLM 0.33 can hear of a failed load only as a failed *request*
(``failed_recving``), and only while that request waits for an asynchronous load: a synchronous
load's request already runs in the step that would discover the failure, and its block ids cannot
be mapped back (the scheduler raises). So with several groups every load is planned asynchronous,
whatever ``sync_load_budget_bytes`` says (one warning at start): a failed load then fails or
recomputes its request alone.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata, TransferStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.v1.kv_offload.base import OffloadingSpec
from vllm.v1.outputs import KVConnectorOutput

from ascend_dist.kv_offload.messages import decode_failed_stores, encode_failed_stores

__all__ = ["AscendOffloadingConnectorScheduler", "AscendOffloadingWorkerMetadata"]

logger = logging.getLogger(__name__)

# vLLM 0.33's update_connector_output takes the manager lock and runs ``_update_connector_output``
# inside it; vLLM 0.32 has only update_connector_output (no lock). Failed stores are completed in
# whichever of the two runs the job bookkeeping.
_HAS_LOCKED_UPDATE = hasattr(OffloadingConnectorScheduler, "_update_connector_output")


@dataclasses.dataclass
class AscendOffloadingWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker -> scheduler report plus the store jobs whose copy failed.

    vLLM's fields stay vLLM's; ours travel as versioned msgspec bytes (`NativeFailedStores`).

    Attributes:
        failed_payload: encoded store job ids that failed on at least one worker (they are also in
            ``completed_jobs``, so vLLM's per-job worker count still resolves).
    """

    failed_payload: bytes = b""

    @classmethod
    def build(
        cls, completed_jobs: dict[int, int], transfer_stats: TransferStats, failed_jobs: Iterable[int] = ()
    ) -> AscendOffloadingWorkerMetadata:
        """A report of completed jobs with the failed stores among them."""
        return cls(completed_jobs, transfer_stats, encode_failed_stores(failed_jobs))

    @property
    def failed_jobs(self) -> frozenset[int]:
        """The failed store job ids (decoded and version-checked)."""
        return decode_failed_stores(self.failed_payload)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Sum completions and stats as vLLM does; failed jobs are the union of both."""
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)  # vLLM's own aggregate builds one
        failed = other.failed_jobs if isinstance(other, AscendOffloadingWorkerMetadata) else frozenset()
        return AscendOffloadingWorkerMetadata.build(
            merged.completed_jobs, merged.transfer_stats, self.failed_jobs | failed
        )


class AscendOffloadingConnectorScheduler(OffloadingConnectorScheduler):
    """vLLM's scheduler side; a store that failed on any worker completes with ``success=False``.

    The manager then drops the store's chunks (a later lookup misses) instead of making them
    loadable; every other piece of job bookkeeping stays vLLM's.
    """

    def __init__(self, spec: OffloadingSpec, vllm_config: Any, kv_cache_config: Any) -> None:
        """Build vLLM's scheduler state plus the failed stores still awaiting other workers' reports."""
        super().__init__(spec, vllm_config, kv_cache_config)
        self._failed_store_jobs: set[int] = set()
        # vLLM maps load errors back to requests by block id only with one KV-cache group.
        self._async_loads_only = len(kv_cache_config.kv_cache_groups) > 1
        budget = getattr(getattr(self, "config", None), "sync_load_budget_bytes", 0)
        if self._async_loads_only and budget:
            logger.warning(
                "sync_load_budget_bytes=%d ignored: with %d KV-cache groups vLLM cannot be told of a failed "
                "synchronous load (only of a failed asynchronous one), so every offload load is asynchronous",
                budget, len(kv_cache_config.kv_cache_groups),
            )  # fmt: skip

    def _reserve_sync_load(self, req_status: Any, num_computed_tokens: int, num_hit_tokens: int | None) -> bool:
        """The sync-load reservation of vLLM 0.33, refused with several KV-cache groups (see the module doc)."""
        if self._async_loads_only:
            return False
        return super()._reserve_sync_load(req_status, num_computed_tokens, num_hit_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Run vLLM's update; on vLLM 0.32 the failed stores are completed here first."""
        if not _HAS_LOCKED_UPDATE:
            self._fail_reported_stores(connector_output)
        super().update_connector_output(connector_output)

    def _update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Run vLLM 0.33's update under the manager lock, the failed stores completed first."""
        self._fail_reported_stores(connector_output)
        super()._update_connector_output(connector_output)

    def _fail_reported_stores(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, AscendOffloadingWorkerMetadata):
            self._fail_stores(meta)

    def _fail_stores(self, meta: AscendOffloadingWorkerMetadata) -> None:
        """Complete, with ``success=False``, each failed store whose last worker report is in ``meta``."""
        for job_id in meta.failed_jobs:  # decoded once per report
            job = self._jobs.get(job_id)
            if job is not None and job.is_store and job_id >= self._stale_job_threshold:
                self._failed_store_jobs.add(job_id)
        for job_id in sorted(self._failed_store_jobs):
            job = self._jobs.get(job_id)
            if job is None:  # dropped by a cache reset
                self._failed_store_jobs.discard(job_id)
                continue
            if job.pending_count > meta.completed_jobs.get(job_id, 0):
                continue  # other workers still to report
            req_status = self._req_status[job.req_id]
            self.manager.complete_store(job.keys, req_status.req_context, success=False)
            logger.warning("offload store job %d (request %s) failed: chunks dropped", job_id, job.req_id)
            job.keys = set()  # vLLM's completion below then marks nothing stored
            self._failed_store_jobs.discard(job_id)
