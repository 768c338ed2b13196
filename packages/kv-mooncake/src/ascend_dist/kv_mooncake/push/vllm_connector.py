"""``MooncakeLayerwiseConnector`` for vLLM: a thin `KVConnectorBase_V1` delegating to this subpackage.

Runs in: vLLM's scheduler process (role SCHEDULER) and each worker process (role WORKER). With `core.vllm_glue`,
the only code of the subpackage that imports vLLM. It translates vLLM objects (``Request``,
``KVCacheBlocks``, ``SchedulerOutput``, ``KVCacheConfig``, the layer -> tensor dict) into plain values
and calls `LayerwiseScheduler` / `LayerwiseWorker`.

With ``P_tp > D_tp`` (GQA) the worker needs the all-to-all group: it is built from
``torch.distributed`` sub-groups of the TP group (``pd_head_ratio`` consecutive TP ranks; gloo on the
CPU, the device backend elsewhere), created collectively at ``register_kv_caches``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from ascend_dist.common.device import current_device_index
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import load_secret, warn_unauthenticated
from ascend_dist.kv_mooncake.core.admission import ParamsGate
from ascend_dist.kv_mooncake.core.device_fence import write_fence
from ascend_dist.kv_mooncake.core.engine import get_engine
from ascend_dist.kv_mooncake.core.vllm_glue import (
    SchedRequestAdapter,
    StepMetadata,
    admit_bound,
    connector_config,
    parallel_ranks,
    read_kv_caches,
)
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.messages import PushParams
from ascend_dist.kv_mooncake.push.plan import a2a_groups
from ascend_dist.kv_mooncake.push.reshard import AllToAll, GlooAllToAll
from ascend_dist.kv_mooncake.push.scheduler import LayerwiseScheduler, Scheduled
from ascend_dist.kv_mooncake.push.step_metadata import LayerwiseMetadata
from ascend_dist.kv_mooncake.push.worker import LayerwiseWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["MooncakeLayerwiseConnector", "MooncakeLayerwiseMetadata"]

logger = logging.getLogger(__name__)


class MooncakeLayerwiseMetadata(StepMetadata[LayerwiseMetadata]):
    """vLLM's metadata object carrying this subpackage's `LayerwiseMetadata`."""


def _all_to_all(ratio: int, num_heads: int) -> AllToAll | None:
    """This rank's all-to-all sub-group (`plan.a2a_groups`); collective: every TP rank creates every group."""
    if ratio <= 1:
        return None
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    mine = None
    for members in a2a_groups(len(tp.ranks), num_heads, ratio):
        group = dist.new_group([tp.ranks[k] for k in members], backend="gloo")
        if tp.rank_in_group in members:
            mine = group
    return GlooAllToAll(mine)


def _scheduled(out: SchedulerOutput) -> dict[str, Scheduled]:
    """What P scheduled per request in this step (new and running requests)."""
    steps = {
        r.req_id: Scheduled(r.num_computed_tokens, out.num_scheduled_tokens.get(r.req_id, 0), r.block_ids)
        for r in out.scheduled_new_reqs
    }
    cached = out.scheduled_cached_reqs
    for rid, new_ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
        steps[rid] = Scheduled(computed, out.num_scheduled_tokens.get(rid, 0), new_ids)
    return steps


class MooncakeLayerwiseConnector(SchedRequestAdapter[LayerwiseScheduler, LayerwiseWorker]):
    """P/D disaggregation: P pushes each layer into D's blocks as soon as it is computed (vllm-ascend's name)."""

    _bind_flag = "do_remote_decode"  # D binds the blocks it announces to its prompt

    # The multi-connector gives this connector the real blocks and token count even when another
    # child loads, and treats it as a layer-wise reuse provider (its P workers have a reuse gate).
    requires_full_blocks_on_update_after_alloc = True
    supports_layerwise_buffer_reuse = True

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        """Build the scheduler or worker half from vLLM's configuration.

        Raises:
            ConfigError: The kv_transfer_config is invalid; the error names the field.
        """
        super().__init__(vllm_config, role, kv_cache_config)
        self._lw_config = connector_config(vllm_config, type(self).__name__, LayerwiseConfig.from_kv_transfer_config)
        self._started: KVConnectorMetadata | None = None  # the bound metadata whose step was started
        model = vllm_config.model_config
        self._heads = model.get_total_num_kv_heads()
        self._use_mla = bool(model.use_mla)
        if role == KVConnectorRole.SCHEDULER:
            secret = load_secret()  # D signs the blocks it announces, P checks them (`core.capability`)
            if secret is None:
                warn_unauthenticated(type(self).__name__)
            self._scheduler = LayerwiseScheduler(self._lw_config, self._block_sizes, secret=secret)
            self._gate = ParamsGate(type(self).__name__, self._scheduler.check_params, PushParams.__struct_fields__)
        else:
            self._tp_rank, _, self._pcp_rank = parallel_ranks()
            self.device_index = current_device_index()  # vLLM's worker made its device current

    # ---- scheduler side -------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Admit the request's kv_transfer_params (see `ParamsGate`): hostile ones are dropped here, once.

        P also requires them bound to its prompt (D's announced digest): see `core.vllm_glue.admit_bound`.
        """
        if self._gate is not None:
            admit_bound(self._gate, request, self._bind_flag)

    # get_num_new_matched_tokens (the base's pure query): D gets the tokens P pushes (async), P none.

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """D: announce ALL the request's blocks to the metaserver; P: start tracking the push."""
        self._sched().update_state_after_alloc(
            self._admitted(request, digest=not self._lw_config.is_producer),  # D announces it
            blocks.get_block_ids(),
            num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's waits (D) and pushes (P)."""
        return MooncakeLayerwiseMetadata(self._sched().build_connector_meta(_scheduled(scheduler_output)))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are freed at once (P: the reuse gate protects layers still in flight)."""
        return self._sched().request_finished(self._admitted(request), [block_ids])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """As `request_finished`, every KV group."""
        return self._sched().request_finished(self._admitted(request), list(block_ids))

    # ---- worker side ----------------------------------------------------------------------------

    def _work(self) -> LayerwiseWorker:
        if self._worker is None:
            raise ConfigError("register_kv_caches", "not called", "called first (WORKER role)")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's caches: ``[B, H, N, C]`` views (vLLM >= 0.32), split K/V, or MLA tensors.

        Raises:
            LayoutError: A tensor's layout cannot be served (e.g. vLLM's ``LHBNC``); names the layout.
        """
        if self._scheduler is not None:
            raise ConfigError("role", "SCHEDULER", "WORKER for register_kv_caches")
        parts, layout = read_kv_caches(kv_caches, self._vllm_config)
        cfg = self._lw_config
        ratio = self._lw_config.parallel_infos(1 if self._use_mla else self._heads, self._use_mla)[0].pd_head_ratio
        self._worker = LayerwiseWorker(
            self._lw_config,
            tp_rank=self._tp_rank,
            pcp_rank=self._pcp_rank,
            num_kv_heads=self._heads,
            use_mla=self._use_mla,
            all_to_all=_all_to_all(ratio, self._heads) if self._lw_config.is_producer else None,
            engine=self.counting_engine(lambda: get_engine(cfg.host, cfg.protocol)),
        )
        groups = [[n for n in g if n in parts] for g in self._groups]
        self._worker.register_kv_caches(
            parts, groups=groups, num_blocks=self._num_blocks, block_size=self._block_sizes[0], layout=layout
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata and start the step: P's pushes must be planned before the forward.

        vLLM (0.32, 0.33) calls `start_load_kv` AFTER the forward when the step has no synchronous
        loads, by which time every `save_kv_layer` of the step has run; binding happens before it.
        """
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._start_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """The step was started when its metadata was bound (see `bind_connector_metadata`)."""
        self._start_step()

    def _start_step(self) -> None:
        """D: start waiting for announced requests; P: plan this step's pushes. Once per bound metadata."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, MooncakeLayerwiseMetadata):
            raise ConfigError("connector_metadata", type(meta).__name__, "MooncakeLayerwiseMetadata")
        if meta is self._started:
            return
        self._started = meta
        self._work().start_load_kv(meta.inner)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """P: the layer's reuse gate (its storage is no longer being pushed); D: async loads, no wait."""
        self._work().wait_for_layer_load(layer_name)

    def wait_for_layer_reuse(self, layer_name: str) -> None:
        """The multi-connector's provider hook: same as P's `wait_for_layer_load`."""
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """P: queue the layer's push; its send waits for the device event after the layer's KV write."""
        self._work().save_kv_layer(layer_name, self._fence)

    def _fence(self) -> Callable[[], None] | None:
        return write_fence(self.device_index, self._lw_config.gate_timeout_s)

    def wait_for_save(self) -> None:
        """Pushes are asynchronous; storage reuse is ordered by the reuse gate."""

    # get_finished / get_transfer_results / get_block_ids_with_load_errors: the base's (D: received or
    # failed requests and their blocks; P frees at once, so nothing is sending).

    def _failed_recving(self, recving: set[str] | None) -> set[str]:
        return self._work().take_failed()

    def shutdown(self) -> None:
        """Stop threads, sockets and registrations (the scheduler's metaserver client too)."""
        super().shutdown()
        if self._scheduler is not None:
            self._scheduler.close()
