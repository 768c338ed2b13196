"""vLLM adapter of simple CPU offload on Ascend: the ``SimpleCPUOffloadConnector`` override.

Runs in: vLLM's worker processes (the scheduler side is vLLM's own, unchanged). The only module of
the simple path that imports vLLM. After vLLM's constructor runs, a worker-role connector whose
upstream handler exists (prefix caching on) gets `AscendSimpleWorkerHandler` instead: views of
every sub-tensor (nothing dropped), copies through the device runtime on a background thread, and
the host block count from the one capacity formula.

Configure with ``kv_connector_extra_config``: ``cpu_bytes_to_use`` (server-wide, default 8 GiB),
``cpu_bytes_to_use_per_rank``, optional ``num_cpu_blocks`` (at most the byte budget's count),
``lazy_offload`` (vLLM's scheduler option).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata, SimpleCPUOffloadWorkerMetadata

from ascend_dist.common.device import DeviceRuntime, get_runtime
from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_offload.capacity import HostCapacity, per_rank_capacity
from ascend_dist.kv_offload.simple_worker import SimpleOffloadWorker

__all__ = ["AscendSimpleCPUOffloadConnector", "AscendSimpleWorkerHandler", "simple_capacity"]

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


class AscendSimpleWorkerHandler:
    """vLLM's simple worker-handler interface over `SimpleOffloadWorker`."""

    def __init__(self, capacity: HostCapacity, num_blocks: int, runtime: DeviceRuntime | None = None) -> None:
        """Remember the capacity and the device block count."""
        self.inner = SimpleOffloadWorker(runtime or get_runtime(), capacity)
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

    def build_connector_worker_meta(self) -> SimpleCPUOffloadWorkerMetadata | None:
        """Stores finished since the last call."""
        done = self.inner.build_connector_worker_meta()
        return None if done is None else SimpleCPUOffloadWorkerMetadata(completed_store_events=done)

    def handle_preemptions(self, metadata: SimpleCPUOffloadMetadata) -> None:
        """Flush every transfer when the plan asks for it."""
        self.inner.handle_preemptions(metadata)

    def shutdown(self) -> None:
        """Stop the copy thread and drain."""
        self.inner.shutdown()


class AscendSimpleCPUOffloadConnector(SimpleCPUOffloadConnector):
    """``SimpleCPUOffloadConnector`` with the Ascend worker handler."""

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
            self.ascend_handler = AscendSimpleWorkerHandler(capacity, int(kv_cache_config.num_blocks))
            self.worker_handler = self.ascend_handler  # type: ignore[assignment]

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call."""
        return set() if self.ascend_handler is None else self.ascend_handler.inner.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Stop our copy thread, then vLLM's shutdown."""
        if self.ascend_handler is not None:
            self.ascend_handler.shutdown()
        super().shutdown()
