"""vLLM adapter of native offloading on Ascend: the spec, its worker and the layout adapter.

Runs in: vLLM's scheduler and worker processes. The only module of the native path that imports
vLLM (0.33: ``vllm.v1.kv_offload`` and ``...kv_connector.v1.offloading``).

- `NPUOffloadingSpec` keeps vLLM's CPU tier (capacity, manager, eviction policies) and swaps in our
  transfer worker; legacy ``num_cpu_blocks`` is translated into ``cpu_bytes_to_use`` on a copy of
  the config (vLLM's config object is never mutated).
- `NPUOffloadingWorker` is vLLM's ``OffloadingWorker`` over `OffloadWorker` (batched, coalesced,
  in-order, failures reported per job).
- `AscendOffloadingConnector` is vLLM's ``OffloadingConnector`` whose worker canonicalises Ascend
  tuple/list layouts (split K/V, MLA, scales, Mamba states) with `canonical_block_views` before
  handing them to the spec; single-tensor layouts go through vLLM's own path unchanged.

Select it with ``kv_connector_extra_config = {"spec_name": "NPUOffloadingSpec",
"spec_module_path": "ascend_dist.kv_offload.vllm_native", "cpu_bytes_to_use": ...}``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec, UniformTypeKVCacheSpecs
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ascend_dist.common.block_views import BlockView, canonical_block_views
from ascend_dist.common.device import DeviceRuntime, get_runtime
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.layouts import layer_parts
from ascend_dist.kv_offload.capacity import normalise_legacy_native_config
from ascend_dist.kv_offload.offload_worker import GroupRef, OffloadWorker

__all__ = [
    "AscendOffloadingConnector",
    "AscendOffloadingConnectorWorker",
    "NPUOffloadingSpec",
    "NPUOffloadingWorker",
    "canonicalise_kv_caches",
    "unpadded_page",
]

logger = logging.getLogger(__name__)


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
            runtime or get_runtime(), views, refs, num_chunks=num_chunks, blocks_per_chunk=blocks_per_chunk
        )
        self.load_errors: set[int] = set()

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
        """Finished stores then loads; failed loads also leave their device blocks in `load_errors`."""
        out: list[TransferResult] = []
        for r in self.worker.get_finished():
            if not r.success:
                self.load_errors.update(r.failed_block_ids)
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
    """Canonical views of Ascend layouts (spec 1.3), deduplicated, with per-group refs.

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


class AscendOffloadingConnectorWorker(OffloadingConnectorWorker):
    """vLLM's connector worker with the Ascend layout adapter at the registration boundary."""

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


class AscendOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` override: same scheduler, Ascend layout adapter on the worker."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        """Run vLLM's constructor, then swap the worker side for the Ascend one (same spec)."""
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:
            self.connector_worker = AscendOffloadingConnectorWorker(
                self.connector_worker.spec, vllm_config, kv_cache_config
            )
