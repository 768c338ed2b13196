"""vLLM adapter of the recompute (preempt) CPU offload connector: ``RecomputeCPUOffloadConnector``.

Runs in: vLLM's scheduler process (role SCHEDULER: `RecomputeManager`) and each worker (role
WORKER: `RecomputeWorker`). The only module of the recompute path that imports vLLM. It translates
vLLM's request, block and output objects into our types; the metadata travels as msgspec bytes
inside vLLM's metadata objects (our payload is never pickled).

Configure with ``kv_connector_extra_config``: ``cpu_bytes_to_use`` (default 8 GiB, server-wide),
``cpu_bytes_to_use_per_rank`` (recommended), ``enable_offload_prefix_caching`` (bool, default
false). The scheduler calls ``update_state_before_preempt`` (Ascend's RecomputeScheduler does).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

from ascend_dist.common.device import DeviceRuntime, tensors_runtime
from ascend_dist.common.vllm_stats import TransferStatsReporting
from ascend_dist.kv_offload.block_views import BlockView, canonical_block_views, dedup_views
from ascend_dist.kv_offload.capacity import HostCapacity, per_rank_capacity
from ascend_dist.kv_offload.layouts import layer_parts
from ascend_dist.kv_offload.messages import decode_metadata, decode_worker_meta, encode_message
from ascend_dist.kv_offload.recompute_plan import GroupKind, GroupSpec
from ascend_dist.kv_offload.recompute_scheduler import RecomputeManager
from ascend_dist.kv_offload.recompute_worker import RecomputeWorker
from ascend_dist.kv_offload.vllm_native import unpadded_page

__all__ = ["RecomputeCPUOffloadConnector", "RecomputeConnectorMetadata", "RecomputeConnectorWorkerMetadata"]

logger = logging.getLogger(__name__)


@dataclass
class RecomputeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker: msgspec bytes of `RecomputeMetadata`."""

    payload: bytes


@dataclass
class RecomputeConnectorWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: msgspec bytes of `RecomputeWorkerMeta`, summed by `aggregate`."""

    payload: bytes

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Sum the per-event counts of two workers."""
        assert isinstance(other, RecomputeConnectorWorkerMetadata)
        merged = decode_worker_meta(self.payload).aggregate(decode_worker_meta(other.payload))
        return RecomputeConnectorWorkerMetadata(encode_message(merged))


class _BlockPoolRefs:
    """`DevicePool` over vLLM's BlockPool (touch = ref++, free_blocks = ref--)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def touch(self, block_ids: Sequence[int]) -> None:
        self._pool.touch([self._pool.blocks[b] for b in block_ids])

    def free(self, block_ids: Sequence[int]) -> None:
        self._pool.free_blocks([self._pool.blocks[b] for b in block_ids])


def _group_specs(kv_cache_config: Any) -> list[GroupSpec]:
    specs = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = GroupKind.MAMBA if isinstance(spec, MambaSpec) else GroupKind.FULL
        if isinstance(spec, SlidingWindowSpec):
            kind = GroupKind.SLIDING_WINDOW
        specs.append(GroupSpec(kind, int(spec.block_size)))
    return specs


def host_capacity(vllm_config: Any, kv_cache_config: Any) -> HostCapacity:
    """The one host-capacity formula, from vLLM's configs (scheduler and worker call the same)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    per_rank = per_rank_capacity(extra, vllm_config.parallel_config.world_size)
    total = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors if t.layers)
    return HostCapacity.from_device(int(kv_cache_config.num_blocks), total, per_rank)


class RecomputeCPUOffloadConnector(TransferStatsReporting, KVConnectorBase_V1, SupportsHMA):
    """Save a preempted request's KV to host memory; restore it when the request resumes."""

    # ``offload`` (vllm:ascend_offload_* {direction}): the workers record each store (``save``,
    # device -> host) and restore (``load``, host -> device) job: bytes, time, descriptors, failures
    stats_channels = ("offload",)

    runtime: DeviceRuntime | None = None
    """Device runtime of the worker side (set before ``register_kv_caches``); None: the process-wide one."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        """Build the scheduler manager or, on a worker, remember the capacity until registration."""
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.capacity = host_capacity(vllm_config, kv_cache_config)
        spec_cfg = getattr(vllm_config, "speculative_config", None)
        num_spec = int(getattr(spec_cfg, "num_speculative_tokens", 0) or 0)
        self.manager: RecomputeManager | None = None
        self.worker: RecomputeWorker | None = None
        self._warned_resumes: dict[str, int] = {}  # request id -> preemption last warned about
        if role == KVConnectorRole.SCHEDULER:
            self.manager = RecomputeManager(
                _group_specs(kv_cache_config), self.capacity.num_cpu_blocks,
                world_size=vllm_config.parallel_config.world_size, num_spec_tokens=num_spec,
                enable_prefix_caching=extra.get("enable_offload_prefix_caching", False),
            )  # fmt: skip

    # -- scheduler side -------------------------------------------------------------------------------

    def _mgr(self) -> RecomputeManager:
        assert self.manager is not None, "scheduler-side call on a worker connector"
        return self.manager

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Reference counting of device blocks during restores."""
        self._mgr().bind_device_pool(_BlockPoolRefs(gpu_block_pool))

    def update_state_before_preempt(
        self, request: Any, block_ids_per_group: Sequence[Sequence[int]], num_computed_tokens: int
    ) -> bool:
        """Ascend RecomputeScheduler hook: True when the request's KV will be saved."""
        hashes = [bytes(h) for h in getattr(request, "block_hashes", ())]
        return self._mgr().update_state_before_preempt(
            request.request_id, block_ids_per_group, num_computed_tokens, hashes
        )

    def has_preempted_request(self, req_id: str) -> bool:
        """Whether saved KV exists for ``req_id`` (MultiConnector priority)."""
        return self.manager is not None and self.manager.has_preempted_request(req_id)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Saved tokens beyond ``num_computed_tokens`` (asynchronous), or None while the store is pending."""
        manager = self._mgr()
        had_saved = manager.has_preempted_request(request.request_id)
        matched = manager.get_num_new_matched_tokens(request.request_id, request.num_tokens, num_computed_tokens)
        if not had_saved:
            self._warn_unsaved_resume(request)
        return matched

    def _warn_unsaved_resume(self, request: Any) -> None:
        """Say so when a preempted request resumes with nothing saved (once per preemption).

        vLLM's own scheduler never calls `update_state_before_preempt` (Ascend's RecomputeScheduler
        and our `PreemptSavingScheduler` do): with it, every preemption is recomputed and this
        connector only costs its host pool. A saved request that the device prefix cache already
        covers on resume is not warned about: nothing is recomputed then.
        """
        preemptions = int(getattr(request, "num_preemptions", 0) or 0)
        if not preemptions or self._warned_resumes.get(request.request_id) == preemptions:
            return
        self._warned_resumes[request.request_id] = preemptions
        logger.warning(
            "request %s resumes after preemption %d with no saved KV: recomputed (did the scheduler "
            "call update_state_before_preempt? vLLM's own does not, Ascend's RecomputeScheduler does)",
            request.request_id, preemptions,
        )  # fmt: skip

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Map saved host blocks onto the new device blocks."""
        ids = blocks.get_block_ids()
        self._mgr().update_state_after_alloc(request.request_id, request.num_tokens, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's store/load events as msgspec bytes."""
        del scheduler_output
        return RecomputeConnectorMetadata(encode_message(self._mgr().build_meta()))

    def update_connector_output(self, connector_output: Any) -> None:
        """Finished restores and the workers' store acknowledgements."""
        meta = connector_output.kv_connector_worker_meta
        worker_meta = decode_worker_meta(meta.payload) if isinstance(meta, RecomputeConnectorWorkerMetadata) else None
        self._mgr().update_connector_output(connector_output.finished_recving or (), worker_meta)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Never delays freeing (copies are synchronous or ref-counted)."""
        del block_ids
        self._warned_resumes.pop(request.request_id, None)
        return self._mgr().request_finished(request.request_id)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hybrid-aware variant of `request_finished`."""
        del block_ids
        self._warned_resumes.pop(request.request_id, None)
        return self._mgr().request_finished(request.request_id)

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while saves or restores are in flight."""
        return self.manager is not None and self.manager.has_pending_transfers()

    def reset_cache(self) -> bool | None:
        """Refused (False) while anything is pending."""
        return None if self.manager is None else self.manager.reset_cache()

    def take_events(self) -> Iterable[Any]:
        """No KV events from the host pool."""
        return ()

    # -- worker side ----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Canonical views of every layer's parts; host blocks = the scheduler's count."""
        num_blocks = int(self._kv_cache_config.num_blocks)
        pages = {
            name: unpadded_page(g.kv_cache_spec)
            for g in self._kv_cache_config.kv_cache_groups
            for name in g.layer_names
        }
        views: list[BlockView] = []
        for name, value in kv_caches.items():
            views += canonical_block_views(layer_parts(value), num_blocks, pages[name])
        # vLLM maps block-level load errors back to requests only with one KV-cache group.
        single_group = len(self._kv_cache_config.kv_cache_groups) == 1
        self.worker = RecomputeWorker(
            self.runtime or tensors_runtime(v.tensor for v in views),
            dedup_views(views),
            self.capacity,
            block_level_errors=single_group,
            stats=self.transfer_stats,
        )

    def _wrk(self) -> RecomputeWorker:
        assert self.worker is not None, "worker-side call before register_kv_caches"
        return self.worker

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Decode and bind this step's plan."""
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, RecomputeConnectorMetadata)
        self._wrk().bind_connector_metadata(decode_metadata(connector_metadata.payload))

    def clear_connector_metadata(self) -> None:
        """End of step."""
        super().clear_connector_metadata()
        self._wrk().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Synchronous store of the blocks preempted this step (before they are reused)."""
        assert isinstance(kv_connector_metadata, RecomputeConnectorMetadata)
        self._wrk().handle_preemptions(decode_metadata(kv_connector_metadata.payload))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Submit this step's restore."""
        del forward_context, kwargs
        self._wrk().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The compute stream waits for restores once per step."""
        del layer_name
        self._wrk().wait_for_layer_load()

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: saving happens on preemption only."""

    def wait_for_save(self) -> None:
        """Nothing to wait for."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(None, requests whose restore finished)``."""
        del finished_req_ids
        return None, self._wrk().get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished restores, and (several KV-cache groups) the requests whose restore failed among them."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = set() if self.worker is None else self.worker.take_failed_recving()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose restore failed (one KV-cache group): vLLM recomputes them."""
        return set() if self.worker is None else self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This worker's store acknowledgements, or None."""
        meta = None if self.worker is None else self.worker.build_connector_worker_meta()
        return None if meta is None else RecomputeConnectorWorkerMetadata(encode_message(meta))

    def shutdown(self) -> None:
        """Drain the worker's transfers."""
        if self.worker is not None:
            self.worker.shutdown()
