"""AscendMultiConnector: vLLM's MultiConnector with vllm-ascend's composition rules.

Runs in: the scheduler process and every worker process (vLLM adapter; the only module of the
multi-connector importing vLLM). The children are built by vLLM's own MultiConnector from
``kv_connector_extra_config.connectors``; every rule that differs from vLLM's lives in
`_multi_rules` and is applied here: the preempted-request holder answers first, the chosen
loader and full-block children get the real blocks, at most one child returns kv_transfer_params,
layer hooks reach layer-buffer-reuse providers first, a store child can wait on the providers'
reuse gates at layer entry, and Mamba state-copy hooks are forwarded.

Configure::

    --kv-transfer-config '{"kv_connector": "AscendMultiConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer", ...},
        {"kv_connector": "RecomputeCPUOffloadConnector", "kv_role": "kv_both", ...}],
        "non_loader_blocks": "real"}}'

``non_loader_blocks`` ("real", the default, or "empty"): whether children that do not load a
request still see its allocated blocks (with 0 tokens) in `update_state_after_alloc`. "real" is
vLLM 0.33's behaviour, which vLLM's OffloadingConnector relies on; "empty" is vllm-ascend's (it
targeted an older vLLM that passed empty blocks). Children declaring
``requires_full_blocks_on_update_after_alloc`` always get the real blocks and the real count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector, MultiKVConnectorMetadata

from ascend_dist.common.errors import ConfigError
from ascend_dist.plugin._multi_rules import (
    Child,
    Composition,
    ExtraSaves,
    ReuseProvider,
    merge_finished_params,
    merge_transfer_results,
)
from ascend_dist.plugin.multi_stats import children_prom_metrics, children_stats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["AscendMultiConnector"]


def _is_reuse_provider(child: KVConnectorBase_V1, child_config: KVTransferConfig) -> bool:
    """A producer with a worker that declares layer-buffer reuse and implements its gate."""
    return (
        child.role == KVConnectorRole.WORKER
        and child_config.is_kv_producer
        and bool(getattr(child, "supports_layerwise_buffer_reuse", False))
        and isinstance(child, ReuseProvider)
    )


def _check_config(vllm_config: VllmConfig) -> None:
    """Typed errors for what vLLM's MultiConnector would only assert (or crash on) later."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ConfigError("kv_transfer_config", None, "set, with kv_connector_extra_config.connectors")
    children = (ktc.kv_connector_extra_config or {}).get("connectors")
    if not isinstance(children, list) or not children:
        raise ConfigError("kv_connector_extra_config.connectors", children, "a non-empty list of child configs")
    for i, child in enumerate(children):
        if not isinstance(child, dict) or not isinstance(child.get("kv_connector"), str):
            raise ConfigError(f"kv_connector_extra_config.connectors[{i}]", child, 'a dict with a "kv_connector" name')
    hma_off = vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    if not hma_off and not MultiConnector.all_children_support_hma(ktc):
        names = [child["kv_connector"] for child in children]
        raise ConfigError(
            "scheduler_config.disable_hybrid_kv_cache_manager",
            hma_off,
            f"True: not every child of {names} supports the hybrid KV-cache manager (or name this connector "
            '"MultiConnector", for which vLLM turns HMA off by itself)',
        )


NON_LOADER_BLOCKS = ("real", "empty")


def _non_loader_blocks(vllm_config: VllmConfig) -> str:
    """``kv_connector_extra_config.non_loader_blocks``: what non-loading children see after allocation."""
    ktc = vllm_config.kv_transfer_config
    value = (ktc.kv_connector_extra_config or {}).get("non_loader_blocks", "real") if ktc else "real"
    if value not in NON_LOADER_BLOCKS:
        raise ConfigError("kv_connector_extra_config.non_loader_blocks", value, f"one of {list(NON_LOADER_BLOCKS)}")
    return value


class AscendMultiConnector(MultiConnector):
    """Compose several KV connectors; vllm-ascend's ordering and ownership rules on top of vLLM's."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        """Build the children (vLLM's MultiConnector) and the composition rules over them.

        Raises:
            ConfigError: ``kv_connector_extra_config.connectors`` is not a non-empty list of dicts
                each naming a ``kv_connector``; ``non_loader_blocks`` is not "real" or "empty"; or
                the hybrid KV-cache manager (HMA) is on while a child does not support it.
        """
        _check_config(vllm_config)
        _non_loader_blocks(vllm_config)
        super().__init__(vllm_config, role, kv_cache_config)
        children = self._connectors
        self._rules = Composition(
            cast("list[Child]", children),
            reuse_providers=self._reuse_providers(),
            full_blocks=[bool(getattr(c, "requires_full_blocks_on_update_after_alloc", False)) for c in children],
            others_get_real_blocks=_non_loader_blocks(vllm_config) == "real",
        )
        self._requests_to_connector = self._rules.chosen  # vLLM's lookups by chosen loader share it
        self._saves = ExtraSaves()
        self._extra_async_saves = self._saves.pending
        if role == KVConnectorRole.WORKER:
            self._rules.configure_layerwise_reuse_completion()

    def _reuse_providers(self) -> list[bool]:
        return [
            _is_reuse_provider(c, cfg) for c, cfg in zip(self._connectors, self._ktc_kv_transfer_config, strict=True)
        ]

    @property
    def composition(self) -> Composition:
        """The rules object (children, providers, chosen loaders); for diagnostics and tests."""
        return self._rules

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Preempted-request holder first, then the first child in config order with tokens."""
        return self._rules.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Real blocks and count to the loader and full-block children; 0 (real or empty blocks) to the rest."""
        empty = blocks.new_empty()
        plans = self._rules.alloc_plan(request.request_id, num_external_tokens)
        for child, plan in zip(self._connectors, plans, strict=True):
            child.update_state_after_alloc(request, blocks if plan.real_blocks else empty, plan.num_external_tokens)

    def update_state_before_preempt(self, request: Request, block_ids: Any, num_computed_tokens: int) -> bool:
        """Ascend RecomputeScheduler hook: offer the request to every child that saves preempted requests."""
        return self._rules.update_state_before_preempt(request, block_ids, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        """Every child's metadata, in order, plus the extra async saves recorded since the last step."""
        metadata = MultiKVConnectorMetadata(
            metadata=tuple(c.build_connector_meta(scheduler_output) for c in self._connectors)
        )
        metadata.extra_async_saves = self._saves.take()
        self._extra_async_saves = self._saves.pending
        return metadata

    def request_finished(self, request: Request, blocks: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Every child's answer; at most one may return kv_transfer_params."""
        return self._finish(request, [c.request_finished(request, blocks) for c in self._connectors])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """HMA form: a single group falls back to `request_finished` unless all children support HMA."""
        if not self._all_support_hma:
            if len(block_ids) != 1:
                raise RuntimeError(
                    f"{len(block_ids)} KV cache groups need every child connector to support HMA; some do not"
                )
            return self.request_finished(request, block_ids[0])
        answers = [cast("SupportsHMA", c).request_finished_all_groups(request, block_ids) for c in self._connectors]
        return self._finish(request, answers)

    def _finish(
        self, request: Request, answers: list[tuple[bool, dict[str, Any] | None]]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._rules.forget(request.request_id)
        delaying, params = merge_finished_params(answers)
        self._saves.record(request.request_id, delaying)
        return delaying > 0, params

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Register with every child, then re-read the reuse providers and re-offer the waiter.

        A child may only decide whether it reuses layer buffers once it saw the caches.
        """
        super().register_kv_caches(kv_caches)
        self._rules.set_reuse_providers(self._reuse_providers())
        self._rules.configure_layerwise_reuse_completion()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind each child's part and absorb the scheduler's extra async-save counts."""
        if not isinstance(connector_metadata, MultiKVConnectorMetadata):
            raise TypeError(f"expected MultiKVConnectorMetadata, got {type(connector_metadata).__name__}")
        self._saves.absorb(connector_metadata.extra_async_saves)
        for child, meta in zip(self._connectors, connector_metadata.metadata, strict=True):
            child.bind_connector_metadata(meta)
        KVConnectorBase_V1.bind_connector_metadata(self, connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Reuse providers first; skipped entirely when a sink waits on them at layer entry."""
        self._rules.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Reuse providers first (they close their gates), then the others."""
        self._rules.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def on_kv_cache_written(self, layer_name: str) -> None:
        """vllm-ascend's early per-layer hook, providers first, to children that have it."""
        self._rules.on_kv_cache_written(layer_name)

    def _wait_for_external_slot_release(self, layer_name: str) -> None:
        """Wait on every reuse provider's gate for ``layer_name`` (the waiter handed to sinks)."""
        self._rules.wait_for_external_slot_release(layer_name)

    def _configure_layerwise_reuse_completion(self) -> bool:
        """Offer the slot-release waiter to the sinks again; True when one accepted."""
        return self._rules.configure_layerwise_reuse_completion()

    def prepare_mamba_state_copy(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Forward to the children with Mamba copy hooks, in config order."""
        return self._rules.prepare_mamba_state_copy(*args, **kwargs)

    def finish_mamba_state_copy(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Forward to the children with Mamba copy hooks, in reverse config order."""
        return self._rules.finish_mamba_state_copy(*args, **kwargs)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Union of receives; a send is finished once every delaying child reported it."""
        per_child = []
        for child in self._connectors:
            r = child.get_transfer_results(finished_req_ids)
            per_child.append((r.finished_sending, r.finished_recving, r.failed_recving))
        sending, recving, failed = merge_transfer_results(per_child, self._saves)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """The children's stats by class name (ours recognised by their payload, see `multi_stats`)."""
        return children_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        """The children's metrics; ours share one registration (see `multi_stats`)."""
        children = cls._get_connector_classes_and_configs(vllm_config)
        return children_prom_metrics(children, vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Union of every child's failed block ids."""
        return self._rules.get_block_ids_with_load_errors()
