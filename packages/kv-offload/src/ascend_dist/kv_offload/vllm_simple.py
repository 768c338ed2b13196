"""vLLM adapter of simple CPU offload on Ascend: the ``SimpleCPUOffloadConnector`` override.

Runs in: vLLM's worker processes and its scheduler process (where the scheduler side is vLLM's own,
except for failed stores). The only module of the simple path that imports vLLM. After vLLM's
constructor runs, a worker-role connector whose upstream handler exists (prefix caching on) gets
`AscendSimpleWorkerHandler` instead: views of every sub-tensor (nothing dropped), copies through
the device runtime on a background thread, and the host block count from the one capacity formula.

Failures (vLLM's simple path has no report for them): a failed store is acknowledged, so vLLM
unpins its blocks, and listed in `AscendSimpleWorkerMetadata.failed_store_events`; the
scheduler-role connector then turns vLLM's pending store into an abandoned one (its refs released
without caching, as after a cache reset) before vLLM would make the host blocks discoverable. A
failed load finishes its requests and is reported as device block ids (one KV-cache group) or as
failed requests (``failed_recving``, several groups, where vLLM refuses block ids).

Stats: vLLM's own simple-offload stats (``vllm:simple_kv_offload_*``: blocks, save outcomes, host
usage; no bytes) beside ours (`PairedStatsReporting`, channel ``offload``): each worker's stores
(``save``) and loads (``load``) with their bytes, time and descriptors, and failures by kind as
``vllm:ascend_offload_*{direction}``.

Configure with ``kv_connector_extra_config``: ``cpu_bytes_to_use`` (server-wide, default 8 GiB),
``cpu_bytes_to_use_per_rank``, optional ``num_cpu_blocks`` (at most the byte budget's count),
``lazy_offload`` (vLLM's scheduler option).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata, SimpleCPUOffloadWorkerMetadata
from vllm.v1.simple_kv_offload.metrics import SimpleCPUOffloadStats

from ascend_dist.common.device import DeviceRuntime
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.transfer_stats import TransferStats
from ascend_dist.common.vllm_paired_stats import PairedStats, PairedStatsReporting
from ascend_dist.kv_offload.capacity import HostCapacity, per_rank_capacity
from ascend_dist.kv_offload.simple_worker import SimpleOffloadWorker

__all__ = [
    "AscendSimpleCPUOffloadConnector",
    "AscendSimpleWorkerHandler",
    "AscendSimpleWorkerMetadata",
    "SimpleOffloadStats",
    "abandon_store_event",
    "simple_capacity",
]

logger = logging.getLogger(__name__)

# vLLM 0.33's scheduler takes its host block count from the workers (``get_aligned_num_cpu_blocks``)
# and honours ``num_cpu_blocks``. vLLM 0.32's sizes its pool alone, as ``max(1, gpu_blocks *
# per_rank // kv_cache_tensors[0].size)``, and has no ``num_cpu_blocks``: there the worker must use
# exactly that count.
_SCHEDULER_TAKES_WORKER_COUNT = hasattr(SimpleCPUOffloadConnector, "get_aligned_num_cpu_blocks")


def simple_capacity(vllm_config: Any, kv_cache_config: Any) -> HostCapacity:
    """Host blocks per rank: ``max(1, gpu_blocks * per_rank // device KV bytes)``, or ``num_cpu_blocks``.

    The device KV bytes are vLLM's (``simple_kv_offload``'s ``gpu_total_bytes``, 0.32 and 0.33):
    ``kv_cache_tensors[0].size``. Every `KVCacheTensor` places its layers inside the same backing
    allocation and ``size`` is that whole allocation, so summing the tensors would count it once
    per tensor (too few host blocks with several tensors).

    Raises:
        ConfigError: ``num_cpu_blocks`` is not a positive int within the byte budget's count, or is
            set on vLLM 0.32.
    """
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    per_rank = per_rank_capacity(extra, vllm_config.parallel_config.world_size)
    _refuse_num_cpu_blocks_without_alignment(extra)
    backing_bytes = int(kv_cache_config.kv_cache_tensors[0].size)
    capacity = HostCapacity.from_device(int(kv_cache_config.num_blocks), backing_bytes, per_rank)
    requested = extra.get("num_cpu_blocks")
    if requested is None:
        return capacity
    if type(requested) is not int or not 0 < requested <= capacity.num_cpu_blocks:
        raise ConfigError("num_cpu_blocks", requested, f"an int in 1..{capacity.num_cpu_blocks}")
    return HostCapacity(requested, capacity.capacity_per_rank, capacity.device_bytes_per_block)


def _refuse_num_cpu_blocks_without_alignment(extra: Any) -> None:
    """``num_cpu_blocks`` on vLLM 0.32: its scheduler would size a different pool than the worker."""
    if not _SCHEDULER_TAKES_WORKER_COUNT and extra.get("num_cpu_blocks") is not None:
        raise ConfigError(
            "num_cpu_blocks",
            extra["num_cpu_blocks"],
            "unset on vLLM 0.32 (its scheduler sizes the host pool from cpu_bytes_to_use alone; vLLM 0.33 honours it)",
        )


@dataclasses.dataclass
class AscendSimpleWorkerMetadata(SimpleCPUOffloadWorkerMetadata):
    """vLLM's ``{store_event: workers}`` acknowledgements plus the store events that failed.

    A failed store is acknowledged too (vLLM's per-event worker count must still reach the world
    size to unpin its blocks); ``failed_store_events`` counts the workers on which it failed.
    """

    failed_store_events: dict[int, int] = dataclasses.field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Sum both maps per event across workers."""
        merged = super().aggregate(other)
        assert isinstance(merged, SimpleCPUOffloadWorkerMetadata)  # vLLM's own aggregate builds one
        failed = dict(self.failed_store_events)
        for event, count in getattr(other, "failed_store_events", {}).items():
            failed[event] = failed.get(event, 0) + count
        return AscendSimpleWorkerMetadata(
            completed_store_events=merged.completed_store_events, failed_store_events=failed
        )


def abandon_store_event(manager: Any, event: int) -> bool:
    """Make a pending store of vLLM's ``SimpleCPUOffloadScheduler`` end without caching its blocks.

    vLLM processes an acknowledged store as a success (its host blocks become discoverable). Moved
    to the abandoned stores (vLLM's own path after a cache reset), its refs are released without
    caching once every worker acknowledged it; the request bookkeeping vLLM keeps for a finished
    store is settled here. Returns False when the event is unknown (already ended or reset).
    """
    transfer = manager._store_event_to_blocks.pop(event, None)
    if transfer is None:
        return False
    manager._abandoned_store_event_to_blocks[event] = transfer
    if not manager._lazy_mode:
        manager._in_flight_store_gpu_blocks.difference_update(transfer.gpu_block_ids)
        for req_id in manager._store_event_to_reqs.pop(event, []):
            state = manager._reqs_to_store.get(req_id)
            if state is None:
                continue
            state.store_events.discard(event)
            if state.finished and not state.store_events:
                manager._cleanup_store_request(req_id)
    return True


class AscendSimpleWorkerHandler:
    """vLLM's simple worker-handler interface over `SimpleOffloadWorker`."""

    def __init__(
        self,
        capacity: HostCapacity,
        num_blocks: int,
        runtime: DeviceRuntime | None = None,
        *,
        block_level_errors: bool = True,
        stats: TransferStats | None = None,
    ) -> None:
        """Remember the capacity and the device block count (``block_level_errors``: one KV-cache group)."""
        # None: the process-wide runtime, taken at registration (not here: a runtime set on the
        # connector before registration must be the only one started)
        self.inner = SimpleOffloadWorker(runtime, capacity, block_level_errors=block_level_errors, stats=stats)
        self.num_cpu_blocks = capacity.num_cpu_blocks
        self._num_blocks = num_blocks

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Views of every sub-tensor, host mirrors, copy thread."""
        self.inner.register_kv_caches(kv_caches, self._num_blocks)

    def bind_connector_metadata(self, metadata: SimpleCPUOffloadMetadata) -> None:
        """This step's plan."""
        self.inner.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        """End of step."""
        self.inner.clear_connector_metadata()

    def start_load_kv(self) -> None:
        """Submit this step's load."""
        self.inner.start_load_kv()

    def wait_for_save(self) -> None:
        """Submit this step's store behind compute-done."""
        self.inner.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(None, finished loads)``."""
        return self.inner.get_finished(finished_req_ids)

    def build_connector_worker_meta(self) -> AscendSimpleWorkerMetadata | None:
        """Stores ended since the last call, the failed ones among them listed."""
        done = self.inner.build_connector_worker_meta()
        failed = self.inner.take_failed_stores()
        return (
            None
            if done is None
            else AscendSimpleWorkerMetadata(completed_store_events=done, failed_store_events=failed)
        )

    def handle_preemptions(self, metadata: SimpleCPUOffloadMetadata) -> None:
        """Flush every transfer when the plan asks for it."""
        self.inner.handle_preemptions(metadata)

    def shutdown(self) -> None:
        """Stop the copy thread and drain."""
        self.inner.shutdown()


@dataclasses.dataclass
class SimpleOffloadStats(PairedStats):
    """vLLM's ``SimpleCPUOffloadStats`` (blocks, outcomes; scheduler side) beside ours (bytes, failures; workers)."""

    vllm_stats_cls = SimpleCPUOffloadStats


class AscendSimpleCPUOffloadConnector(PairedStatsReporting, SimpleCPUOffloadConnector):
    """``SimpleCPUOffloadConnector`` with the Ascend worker handler; its transfers in our stats."""

    stats_channels = ("offload",)
    paired_stats_cls = SimpleOffloadStats

    runtime: DeviceRuntime | None = None
    """Device runtime of the worker side (set before ``register_kv_caches``); None: the process-wide one."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        """Run vLLM's constructor, then swap the worker handler (when one exists).

        Raises:
            ConfigError: ``num_cpu_blocks`` on vLLM 0.32 (either role), or a bad host capacity.
        """
        _refuse_num_cpu_blocks_without_alignment(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        super().__init__(vllm_config, role, kv_cache_config)
        self.ascend_handler: AscendSimpleWorkerHandler | None = None
        if role == KVConnectorRole.WORKER and self.worker_handler is not None:
            capacity = simple_capacity(vllm_config, kv_cache_config)
            # vLLM maps block-level load errors back to requests only with one KV-cache group.
            single_group = len(kv_cache_config.kv_cache_groups) == 1
            self.ascend_handler = AscendSimpleWorkerHandler(
                capacity, int(kv_cache_config.num_blocks), block_level_errors=single_group, stats=self.transfer_stats
            )
            self.worker_handler = self.ascend_handler  # type: ignore[assignment]

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Views, host mirrors and copy thread on ``runtime`` (when set), then vLLM's bookkeeping."""
        if self.ascend_handler is not None and self.runtime is not None:
            self.ascend_handler.inner.runtime = self.runtime
        super().register_kv_caches(kv_caches)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads, and (several KV-cache groups) the requests whose load failed among them."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = set() if self.ascend_handler is None else self.ascend_handler.inner.take_failed_recving()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def update_connector_output(self, connector_output: Any) -> None:
        """Scheduler side: failed stores are abandoned first, then vLLM's own completion runs."""
        meta = connector_output.kv_connector_worker_meta
        manager = self.scheduler_manager
        if manager is not None and isinstance(meta, AscendSimpleWorkerMetadata):
            for event in sorted(meta.failed_store_events):
                if abandon_store_event(manager, event):
                    logger.warning("simple offload store event %d failed: its host blocks are not cached", event)
        super().update_connector_output(connector_output)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call (one KV-cache group)."""
        return set() if self.ascend_handler is None else self.ascend_handler.inner.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Stop our copy thread, then vLLM's shutdown."""
        if self.ascend_handler is not None:
            self.ascend_handler.shutdown()
        super().shutdown()
