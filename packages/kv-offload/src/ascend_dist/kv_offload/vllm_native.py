"""vLLM adapter of native offloading on Ascend: the spec, its worker and the layout adapter.

Runs in: vLLM's scheduler and worker processes. With `vllm_native_scheduler`, the only modules of the
native path that import vLLM (0.32 and 0.33: ``vllm.v1.kv_offload``, ``...kv_connector.v1.offloading``).

- `NPUOffloadingSpec` keeps vLLM's CPU tier (capacity, manager, eviction policies) and swaps in our
  transfer worker; legacy ``num_cpu_blocks`` is translated into ``cpu_bytes_to_use`` on a copy of
  the config (vLLM's config object is never mutated).
- `NPUOffloadingWorker` is vLLM's ``OffloadingWorker`` over `OffloadWorker` (batched, coalesced,
  in-order, failures reported per job).
- `AscendOffloadingConnector` is vLLM's ``OffloadingConnector`` whose worker canonicalises Ascend
  tuple/list layouts (split K/V, MLA, scales, Mamba states) with `canonical_block_views` before
  handing them to the spec; single-tensor layouts go through vLLM's own path unchanged.
- Copy failures (vLLM 0.32 and 0.33 assert on them): `AscendOffloadingConnectorWorker` reports a failed
  load's device blocks through ``get_block_ids_with_load_errors`` (one KV-cache group; with
  several, the request through ``failed_recving``) and still finishes its receive; a failed store
  travels in `AscendOffloadingWorkerMetadata` to `AscendOffloadingConnectorScheduler`
  (`vllm_native_scheduler`), which completes it with ``success=False`` so it is never loadable.
- Stats: vLLM's own offloading stats (``vllm:kv_offload_*``, successful jobs only) beside ours
  (`PairedStatsReporting`): each worker's failed jobs as ``vllm:ascend_offload_num_failed_transfers``
  ``{direction, kind}`` (a copy fault: kind ``other``), which vLLM has no metric for.

Select it with ``kv_connector_extra_config = {"cpu_bytes_to_use": ...}``: `AscendOffloadingConnector`
builds `NPUOffloadingSpec` when ``spec_name`` is absent or names vLLM's ``CPUOffloadingSpec`` (whose
worker refuses every platform but CUDA-alike and XPU), so it starts wherever our device runtime
runs (CPU, NPU, CUDA); any other ``spec_name`` (e.g. an out-of-tree spec) is vLLM's factory's.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from ascend_dist.common.device import DeviceRuntime, tensors_runtime
from ascend_dist.common.errors import ConfigError, TransferError
from ascend_dist.common.transfer_stats import FailureKind, TransferStats
from ascend_dist.common.vllm_paired_stats import PairedStats, PairedStatsReporting
from ascend_dist.kv_offload.block_views import BlockView, canonical_block_views
from ascend_dist.kv_offload.capacity import normalise_legacy_native_config
from ascend_dist.kv_offload.layouts import layer_parts
from ascend_dist.kv_offload.offload_worker import GroupRef, OffloadWorker
from ascend_dist.kv_offload.vllm_native_scheduler import (
    AscendOffloadingConnectorScheduler,
    AscendOffloadingWorkerMetadata,
)

__all__ = [
    "AscendOffloadingConnector",
    "AscendOffloadingConnectorScheduler",
    "AscendOffloadingConnectorWorker",
    "AscendOffloadingWorkerMetadata",
    "NPUOffloadingSpec",
    "NativeOffloadStats",
    "NPUOffloadingWorker",
    "canonicalise_kv_caches",
    "unpadded_page",
    "with_ascend_spec",
]

logger = logging.getLogger(__name__)

# vLLM's default spec name (``OffloadingSpecFactory``): its worker copies only on CUDA-alike and XPU.
_VLLM_CPU_SPEC = "CPUOffloadingSpec"


def _block_ids(spec: LoadStoreSpec) -> list[int]:
    return [int(b) for b in getattr(spec, "block_ids")]  # noqa: B009 - every BlockIDs spec has it


class NPUOffloadingWorker(OffloadingWorker):
    """vLLM's single-medium worker contract over our `OffloadWorker`."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, num_chunks: int, blocks_per_chunk: int, runtime: DeviceRuntime | None = None
    ) -> None:
        """Check the canonical tensors and allocate the host tier.

        Raises:
            ConfigError: a tensor that is not int8 2-D, or whose row width differs from its page.
        """
        views: list[BlockView] = []
        for i, t in enumerate(kv_caches.tensors):
            tensor = t.tensor
            if tensor.dtype != torch.int8 or tensor.dim() != 2 or int(tensor.shape[1]) != t.page_size_bytes:
                raise ConfigError(
                    f"kv_caches.tensors[{i}]",
                    f"{tensor.dtype} {tuple(tensor.shape)}",
                    f"int8 [num_blocks, {t.page_size_bytes}]",
                )
            views.append(BlockView(tensor, t.page_size_bytes, int(tensor.stride(0)), tensor.data_ptr()))
        refs = [[GroupRef(r.tensor_idx, r.page_size_bytes) for r in group] for group in kv_caches.group_data_refs]
        self.worker = OffloadWorker(
            runtime or tensors_runtime(v.tensor for v in views),
            views,
            refs,
            num_chunks=num_chunks,
            blocks_per_chunk=blocks_per_chunk,
        )

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Device -> host after the current stream's work."""
        return self.worker.submit_store(
            job_id, _block_ids(src_spec), _block_ids(dst_spec),
            group_sizes=list(src_spec.group_sizes), block_indices=list(src_spec.block_indices),
        )  # fmt: skip

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Host -> device (``expedited`` loads share the in-order load stream)."""
        del expedited
        return self.worker.submit_load(
            job_id, _block_ids(src_spec), _block_ids(dst_spec),
            group_sizes=list(dst_spec.group_sizes), block_indices=list(dst_spec.block_indices),
        )  # fmt: skip

    def get_finished(self) -> list[TransferResult]:
        """Finished stores then loads; a failed job is reported ``success=False`` (and logged)."""
        out: list[TransferResult] = []
        for r in self.worker.get_finished():
            if not r.success:
                logger.warning(
                    "offload job %d failed at descriptor %s (device blocks %s): %s",
                    r.job_id, r.failed_descriptor, list(r.failed_block_ids), r.error,
                )  # fmt: skip
            out.append(TransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time))
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs finished (bounded by the worker's deadline)."""
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        """Drain both directions."""
        self.worker.shutdown()


class NPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with our transfer worker and legacy block-count support."""

    runtime: DeviceRuntime | None = None
    """Device runtime for the worker; None: the process-wide one."""

    def __init__(self, config: OffloadingConfig) -> None:
        """Normalise legacy ``num_cpu_blocks`` on a copy of the config, then build vLLM's CPU spec."""
        extra, forced = normalise_legacy_native_config(
            config.extra_config,
            config.worker_kv_bytes_per_block,
            config.parallel.world_size,
            config.cache.blocks_per_chunk,
            self.BLOCK_SIZE_ALIGNMENT,
        )
        super().__init__(dataclasses.replace(config, extra_config=extra))
        if forced is not None:
            self.num_chunks = forced
        self._npu_worker: NPUOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> NPUOffloadingWorker:
        """Create the worker once (vLLM's CPU spec refuses non-CUDA platforms here)."""
        if self._npu_worker is None:
            self._npu_worker = NPUOffloadingWorker(kv_caches, self.num_chunks, self.blocks_per_chunk, self.runtime)
        return self._npu_worker


def canonicalise_kv_caches(
    kv_caches: Mapping[str, Any], groups: Sequence[Sequence[tuple[str, int]]], num_blocks: int
) -> CanonicalKVCaches:
    """Canonical views of Ascend layouts, deduplicated, with per-group refs.

    Args:
        kv_caches: layer name -> tensor, tuple (K/V, MLA parts, data+scale) or list (Mamba states).
        groups: per KV-cache group, ``(layer name, unpadded page bytes)`` in group order.
        num_blocks: blocks of the KV-cache manager.

    Raises:
        LayoutError: a layout the canonical-view rules reject; ConfigError: no tensor registered.
    """
    tensors: list[CanonicalKVCacheTensor] = []
    index: dict[tuple[int, int, int], int] = {}
    group_refs: list[list[CanonicalKVCacheRef]] = []
    for group in groups:
        refs: list[CanonicalKVCacheRef] = []
        for name, unpadded in group:
            for view in canonical_block_views(layer_parts(kv_caches[name]), num_blocks, unpadded):
                if view.dedup_key not in index:
                    index[view.dedup_key] = len(tensors)
                    tensors.append(CanonicalKVCacheTensor(view.tensor, view.row_bytes))
                refs.append(CanonicalKVCacheRef(index[view.dedup_key], view.copy_bytes))
        group_refs.append(refs)
    if not tensors:
        raise ConfigError("kv_caches", [], "at least one registered KV-cache tensor")
    return CanonicalKVCaches(tensors, group_refs)


def unpadded_page(spec: Any) -> int:
    """Bytes of one block of a layer without padding (Mamba: the sum of its states).

    Raises:
        ConfigError: a spec that is neither attention nor Mamba.
    """
    if isinstance(spec, AttentionSpec):
        return int(spec.unpadded_page_size_bytes)
    if isinstance(spec, MambaSpec):
        return int(dataclasses.replace(spec, page_size_padded=None).page_size_bytes)
    raise ConfigError("kv_cache_spec", type(spec).__name__, "an attention or Mamba spec")


def with_ascend_spec(config: OffloadingConfig) -> OffloadingConfig:
    """``config`` naming `NPUOffloadingSpec` where it names vLLM's CPU spec, explicitly or by default.

    vLLM's factory falls back to ``CPUOffloadingSpec`` when ``spec_name`` is absent; its
    ``get_worker`` raises on any platform but CUDA-alike and XPU. `NPUOffloadingSpec` is the same
    host tier (capacity, manager, eviction policy) with our transfer worker over the device runtime,
    so the default is replaced by ours. A copy is returned; vLLM's config is never mutated.
    """
    extra = dict(config.extra_config)
    if extra.get("spec_name", _VLLM_CPU_SPEC) != _VLLM_CPU_SPEC:
        return config
    extra["spec_name"] = NPUOffloadingSpec.__name__
    extra["spec_module_path"] = __name__
    return dataclasses.replace(config, extra_config=extra)


class AscendOffloadingConnectorWorker(OffloadingConnectorWorker):
    """vLLM's connector worker with the Ascend layout adapter and per-job failure handling.

    vLLM (0.32 and 0.33) asserts that every transfer succeeded; here a failed load reports the job's device
    blocks through `take_load_errors` (vLLM recomputes them) and still finishes the request's
    receive, and a failed store is carried to the scheduler side in
    `AscendOffloadingWorkerMetadata.failed_jobs` so its host chunks never become loadable.
    """

    def __init__(
        self, spec: OffloadingSpec, vllm_config: Any, kv_cache_config: Any, stats: TransferStats | None = None
    ) -> None:
        """Build vLLM's worker state plus the failure bookkeeping (``stats``: where failed jobs are counted)."""
        super().__init__(spec, vllm_config, kv_cache_config)
        self._stats = stats
        self._load_dst: dict[int, list[int]] = {}
        self._failed_stores: set[int] = set()
        self._load_errors: set[int] = set()
        self._failed_recving: set[str] = set()
        # vLLM maps invalid block ids back to requests only with one KV-cache group.
        self._block_ids_unique = len(kv_cache_config.kv_cache_groups) == 1

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:  # type: ignore[override]
        """Single tensors: vLLM's path; tuples/lists: canonical views (nothing dropped)."""
        if all(isinstance(v, torch.Tensor) for v in kv_caches.values()):
            super().register_kv_caches(kv_caches)
            return
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

        config = self.kv_cache_config
        groups: list[list[tuple[str, int]]] = []
        for group_id in get_offloading_group_ids(config):
            group = config.kv_cache_groups[group_id]
            per_layer = (
                group.kv_cache_spec.kv_cache_specs if isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs) else {}
            )
            groups.append([(n, unpadded_page(per_layer.get(n, group.kv_cache_spec))) for n in group.layer_names])
        self._init_worker(canonicalise_kv_caches(kv_caches, groups, config.num_blocks))

    def start_kv_transfers(self, metadata: OffloadingConnectorMetadata) -> None:
        """Remember each load's device blocks (reported if it fails), then vLLM's submission."""
        for job_id, entry in metadata.load_jobs.items():
            self._load_dst[job_id] = _block_ids(entry.dst_spec)
        super().start_kv_transfers(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """Report completions as vLLM does, with failed jobs handled instead of asserted away.

        Returns:
            ``(finished_sending, finished_recving)``: stores never finish sending (vLLM tracks
            them in the worker metadata); a load's request finishes receiving even if it failed.

        Raises:
            ConfigError: called before ``register_kv_caches``.
            TransferError: a synchronous load failed with several KV-cache groups, where vLLM
                has no report for it; `AscendOffloadingConnectorScheduler` plans no synchronous
                load there, so this is reached only with another scheduler side.
        """
        del finished_req_ids
        if self.worker is None:
            raise ConfigError("kv_caches", None, "register_kv_caches() before get_finished()")
        meta = self._connector_worker_meta
        finished_recving: set[str] = set()
        for result in self.worker.get_finished():
            job_id = result.job_id
            is_load = job_id in self._load_jobs
            req_id = self._load_jobs.pop(job_id, None)
            device_blocks = self._load_dst.pop(job_id, [])
            if result.success:
                if result.transfer_time is not None and result.transfer_size is not None:
                    stats = meta.transfer_stats.load if is_load else meta.transfer_stats.store
                    stats.record(result.transfer_size, result.transfer_time)
            else:
                if self._stats is not None:  # a copy fault: vLLM's stats count successful jobs only
                    self._stats.record_failure("load" if is_load else "save", FailureKind.OTHER)
                if is_load:
                    self._fail_load(job_id, req_id, device_blocks)
                else:
                    logger.warning("offload store job %d failed: its host chunks are dropped", job_id)
                    self._failed_stores.add(job_id)
            meta.mark_completed(job_id)
            if req_id is not None:
                finished_recving.add(req_id)
        return set(), finished_recving

    def _fail_load(self, job_id: int, req_id: str | None, device_blocks: list[int]) -> None:
        if self._block_ids_unique:
            logger.warning("offload load job %d failed: device blocks %s are recomputed", job_id, device_blocks)
            self._load_errors.update(device_blocks)
        elif req_id is not None:
            logger.warning("offload load job %d failed: request %s is recomputed", job_id, req_id)
            self._failed_recving.add(req_id)
        else:
            raise TransferError(
                f"synchronous offload load job {job_id} failed with several KV-cache groups, where vLLM "
                "has no report for it; use AscendOffloadingConnector's scheduler side (it plans none there)"
            )

    def take_load_errors(self) -> set[int]:
        """Device blocks of failed loads since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_recving(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call (several KV-cache groups)."""
        failed, self._failed_recving = self._failed_recving, set()
        return failed

    def build_connector_worker_meta(self) -> AscendOffloadingWorkerMetadata | None:
        """Completed jobs since the last call, with the failed stores among them."""
        meta = super().build_connector_worker_meta()
        if meta is None:
            return None
        failed, self._failed_stores = self._failed_stores, set()
        return AscendOffloadingWorkerMetadata.build(meta.completed_jobs, meta.transfer_stats, failed)

    def shutdown(self) -> None:
        """Shut down as vLLM does; the failure bookkeeping is dropped with the jobs."""
        self._load_dst.clear()
        self._failed_stores.clear()
        super().shutdown()


@dataclasses.dataclass
class NativeOffloadStats(PairedStats):
    """vLLM's ``OffloadingConnectorStats`` (bytes and time of successful jobs) beside ours (failures by kind)."""

    vllm_stats_cls = OffloadingConnectorStats


class AscendOffloadingConnector(PairedStatsReporting, OffloadingConnector):
    """``OffloadingConnector`` override: Ascend layout adapter and copy-failure handling on both sides.

    Stats: vLLM's (from the scheduler side) and each worker's failed jobs (ours, channel ``offload``).
    """

    stats_channels = ("offload",)
    paired_stats_cls = NativeOffloadStats

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        """Do what ``OffloadingConnector.__init__`` does, building the Ascend scheduler or worker side.

        Written out rather than calling it so each process builds its side (and spec) once.
        """
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        offloading_config = with_ascend_spec(build_offloading_config(vllm_config, kv_cache_config))
        self._canonical_layout = offloading_config.canonical_layout
        spec = OffloadingSpecFactory.create_spec(offloading_config)
        self.connector_scheduler: OffloadingConnectorScheduler | None = None
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = AscendOffloadingConnectorScheduler(spec, vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = AscendOffloadingConnectorWorker(
                spec, vllm_config, kv_cache_config, stats=self.transfer_stats
            )

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Return vLLM's finished sets plus the requests whose load failed (several KV-cache groups)."""
        sending, recving = self.get_finished(finished_req_ids)
        worker = self.connector_worker
        failed = worker.take_failed_recving() if isinstance(worker, AscendOffloadingConnectorWorker) else set()
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks of failed loads since the last call (one KV-cache group)."""
        worker = self.connector_worker
        return worker.take_load_errors() if isinstance(worker, AscendOffloadingConnectorWorker) else set()
