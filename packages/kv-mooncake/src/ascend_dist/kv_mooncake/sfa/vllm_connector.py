"""``SfaRemoteD2HConnector`` for vLLM: a thin `KVConnectorBase_V1` over the SFA halves.

Runs in: vLLM's scheduler process (role SCHEDULER) and each worker process (role WORKER). With `core.vllm_glue`,
the only code of `ascend_dist.kv_mooncake.sfa` that imports vLLM: it translates vLLM objects (``Request``,
``KVCacheBlocks``, ``SchedulerOutput``, the layer -> tensor dict) into plain values and calls
`ConsumerScheduler` / `ProducerScheduler` / `ConsumerWorker` / `ProducerWorker`.

D's main MLA cache lives in a host pool (upstream: owned by the sparse-KV offload manager). vLLM 0.33
has no such manager; ours (kv-offload's `SparseOffloadManager`) and this worker meet through
`ascend_dist.common.host_pool_share`: whichever claims the device's pool first allocates it, the
other gets the same memory (or a `ConfigError` naming the field whose geometry differs), so decode
reads the rows P sent. The worker exposes its views of the pool as `host_pool`. The wire id of a request
is vLLM's external id (the internal id without the 9-character ``-xxxxxxxx`` suffix vLLM appends).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole

from ascend_dist.common.device import current_device_index, get_runtime
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.host_pool_share import (
    HostPoolGeometry,
    SharedHostPool,
    TensorHostPool,
    claim_host_pool,
    release_host_pool,
)
from ascend_dist.common.secret import load_secret, warn_unauthenticated
from ascend_dist.kv_mooncake.core.admission import ParamsGate
from ascend_dist.kv_mooncake.core.device_fence import write_fence
from ascend_dist.kv_mooncake.core.kv_views import token_rows
from ascend_dist.kv_mooncake.core.metaserver import RetryingAnnouncer
from ascend_dist.kv_mooncake.core.session_owners import session_owners_for
from ascend_dist.kv_mooncake.core.vllm_glue import (
    MooncakeAdapterBase,
    StepMetadata,
    connector_config,
    parallel_ranks,
    read_kv_caches,
)
from ascend_dist.kv_mooncake.sfa.backend import make_backend
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.consumer import ConsumerWorker
from ascend_dist.kv_mooncake.sfa.messages import ContactInfo
from ascend_dist.kv_mooncake.sfa.plan import DestLayer, infer_groups, layer_index
from ascend_dist.kv_mooncake.sfa.producer import ProducerWorker, span_label, tensor_span
from ascend_dist.kv_mooncake.sfa.scheduler import (
    ConsumerMetadata,
    ConsumerScheduler,
    ProducerMetadata,
    ProducerScheduler,
    SfaRequest,
    StepRequest,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ascend_dist.kv_mooncake.core.kv_geometry import CacheLayout

__all__ = ["SfaRemoteD2HConnector", "SfaRemoteD2HMetadata", "external_id"]

logger = logging.getLogger(__name__)

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_id(request_id: str) -> str:
    """The id the proxy knows: vLLM's internal id without its ``-<8 hex>`` suffix."""
    return _SUFFIX.sub("", request_id)


class SfaRemoteD2HMetadata(StepMetadata[ConsumerMetadata | ProducerMetadata]):
    """vLLM's metadata object carrying one step's `ConsumerMetadata` or `ProducerMetadata`."""


def _request(request: Request) -> SfaRequest:
    return SfaRequest(
        request.request_id, external_id(request.request_id), request.num_prompt_tokens, request.kv_transfer_params
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def _token_major(t: torch.Tensor, axes: str, token_bytes: int) -> bool:
    """Token ``j`` of each block at byte ``j * token_bytes`` (the sparse offload manager reads rows so)."""
    rows = token_rows(t, axes)  # [blocks, tokens, heads, content]
    return rows.stride(1) * t.element_size() == token_bytes and rows[0, 0].is_contiguous()


class SfaRemoteD2HConnector(MooncakeAdapterBase):
    """SFA P/D: D reads each layer from P's memory into its host pool while P prefills (vllm-ascend's name)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        """Build the half this process needs.

        Raises:
            ConfigError: The kv_transfer_config is invalid; the error names the field.
            DeviceUnavailable: ``transfer_backend="memfabric"`` without the Ascend driver (worker role).
        """
        super().__init__(vllm_config, role, kv_cache_config)
        self._sfa = connector_config(vllm_config, type(self).__name__, SfaConfig.from_kv_transfer_config)
        self._group_ids = infer_groups(self._groups)
        self._producer_sched: ProducerScheduler | None = None
        self._consumer_sched: ConsumerScheduler | None = None
        self._metaserver: RetryingAnnouncer | None = None
        self._producer: ProducerWorker | None = None
        self._consumer: ConsumerWorker | None = None
        self._started: object | None = None  # the bound metadata whose step was started
        self.host_pool: dict[str, list[torch.Tensor]] = {}  # D: main layer name -> views of the shared pool
        self._shared_pool: SharedHostPool | None = None
        self.device_index = 0  # the worker's device (set below on the worker role)
        if role == KVConnectorRole.SCHEDULER:
            secret = load_secret()  # D signs its contact, P offers reads only for signed ones
            if secret is None:
                warn_unauthenticated(type(self).__name__)
            if self._sfa.is_producer:
                sched: ProducerScheduler | ConsumerScheduler = ProducerScheduler(
                    self._sfa, self._block_sizes, self._group_ids, secret=secret
                )
                self._producer_sched = sched
            else:
                self._metaserver = RetryingAnnouncer()
                sched = ConsumerScheduler(
                    self._sfa, self._block_sizes, self._group_ids, self._metaserver, secret=secret
                )
                self._consumer_sched = sched
            known = {*ContactInfo.__struct_fields__, "batch_kv_transfer_params", "do_virtual"}
            check = sched.check_params
            self._gate = ParamsGate(type(self).__name__, lambda rid, raw, n: check(external_id(rid), raw, n), known)
            return
        side = "Prefill" if self._sfa.is_producer else "Decode"
        sfa = self._sfa
        # vLLM's worker made its device current before building the connector: MemFabric and the
        # write events use that device (upstream opened device 0 on every rank).
        self.device_index = current_device_index()
        # Built now, not on first use: a backend this host cannot run (memfabric without the Ascend
        # driver) must refuse at start, not at the first transfer.
        engine = make_backend(
            sfa.transfer_backend, sfa.host, protocol=sfa.protocol, role=side, device_id=self.device_index
        )
        backend = self.counting_engine(lambda: engine)
        if self._sfa.is_producer:
            self._producer = ProducerWorker(self._sfa, tp_rank=parallel_ranks()[0], backend=backend)
        else:
            sessions = session_owners_for(sfa.protocol) if sfa.transfer_backend == "mooncake" else None
            self._consumer = ConsumerWorker(self._sfa, tp_rank=parallel_ranks()[0], backend=backend, sessions=sessions)

    # ---- scheduler side -------------------------------------------------------------------------

    def _admitted(self, request: Request) -> SfaRequest:
        """The request as the scheduler half sees it; params failing `check_params` are dropped (one warning)."""
        if self._gate is not None:
            self._gate.admit(request, request.num_prompt_tokens)
        return _request(request)

    def on_new_request(self, request: Request) -> None:
        """Admit the request's kv_transfer_params (see `ParamsGate`): hostile ones are dropped here, once."""
        if self._gate is not None:
            self._gate.admit(request, request.num_prompt_tokens)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """D: the prompt tokens P computes for it (async); P: nothing. Rejected params: ``(0, False)``."""
        gate = self._gate
        if self._consumer_sched is None or gate is None:
            return 0, False
        if not gate.accepts(request.request_id, request.kv_transfer_params, request.num_prompt_tokens):
            return 0, False
        return self._consumer_sched.get_num_new_matched_tokens(_request(request), num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """D: record every block of the request (prefix hits included) and post the contact info."""
        req = self._admitted(request)
        if self._consumer_sched is not None:
            ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
            self._consumer_sched.update_state_after_alloc(req, ids, num_external_tokens, request.num_computed_tokens)
        elif self._producer_sched is not None:
            self._producer_sched.update_state_after_alloc(req)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """D: newly allocated requests; P: this step's chunks."""
        if self._consumer_sched is not None:
            return SfaRemoteD2HMetadata(self._consumer_sched.build_connector_meta())
        if self._producer_sched is None:
            raise ConfigError("role", "WORKER", "SCHEDULER for build_connector_meta")
        tokens = scheduler_output.num_scheduled_tokens
        steps = [
            StepRequest(
                r.req_id, r.num_computed_tokens, tokens.get(r.req_id, 0), tuple(map(tuple, r.block_ids)), is_new=True
            )
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            steps.append(
                StepRequest(rid, cached.num_computed_tokens[i], tokens.get(rid, 0), tuple(map(tuple, new or ())))
            )
        return SfaRemoteD2HMetadata(self._producer_sched.build_connector_meta(steps))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Single-group form of `request_finished_all_groups` (vLLM frees the blocks at once)."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Drop the request's state (D also stops its metaserver post)."""
        if self._consumer_sched is not None:
            return self._consumer_sched.request_finished(self._admitted(request))
        if self._producer_sched is not None:
            return self._producer_sched.request_finished(self._admitted(request))
        return False, None

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """P: describe and register its caches. D: allocate/register the host pool and its indexer caches.

        Both read the tensors' layout like the pull connector (vLLM's ``[B, H, N, C]`` views by
        their strides) and send its name in the hello.

        Raises:
            LayoutError: A layout SFA cannot serve (blocks not back to back, e.g. vLLM's ``BLHNC``
                or ``LHBNC``); the error names the layout.
        """
        main_bs = self._block_sizes[self._group_ids.main]
        idx_bs = self._block_sizes[self._group_ids.indexer]
        parts, layout = read_kv_caches(kv_caches, self._vllm_config)
        on = {t.device.index for ts in parts.values() for t in ts if t.device.type != "cpu"}
        if on - {self.device_index}:
            raise ConfigError("kv_caches device", sorted(on), f"the worker's device {self.device_index}")
        if self._producer is not None:
            self._producer.register_kv_caches(parts, block_size=main_bs, indexer_block_size=idx_bs, layout=layout)
            return
        if self._consumer is None:
            raise ConfigError("role", "SCHEDULER", "WORKER for register_kv_caches")
        indexers: dict[str, list[torch.Tensor]] = {}
        mains: dict[str, list[torch.Tensor]] = {}
        for name, ts in parts.items():
            (indexers if "indexer" in name else mains)[name] = ts
        index_of = {layer_index(n): n for n in indexers}
        pooled = self._claim_host_pool(mains, main_bs, layout)
        dest: dict[str, DestLayer] = {}
        regions: list[tuple[int, int]] = []
        for name, pool in pooled.items():
            spans = [tensor_span(name, t, layout) for t in pool]
            idx_name = index_of.get(layer_index(name))
            ispans = [tensor_span(idx_name, t, layout) for t in indexers[idx_name]] if idx_name else []
            dest[name] = DestLayer(
                tuple(s.base for s in spans),
                tuple(s.block_bytes for s in spans),
                tuple(s.base for s in ispans),
                tuple(s.block_bytes for s in ispans),
            )
            regions += [(t.data_ptr(), t.numel() * t.element_size()) for t in pool]
        self._consumer.register(dest, regions, span_label(layout, [(n, t) for n, ts in parts.items() for t in ts]))

    def _claim_host_pool(
        self, mains: dict[str, list[torch.Tensor]], block_size: int, layout: CacheLayout
    ) -> dict[str, list[torch.Tensor]]:
        """D's host pool: the sparse offload manager's if it was created first, else allocated here for it.

        The pool is shared through `ascend_dist.common.host_pool_share` per device (kv-mooncake does
        not import kv-offload): one ``int8 [blocks * block_size, token_bytes]`` tensor per part of
        each main layer, in layer order, viewed here with the shape, dtype and strides of D's own
        cache so P's blocks land byte for byte (the manager reads token rows of those bytes).

        Raises:
            ConfigError: Main layers of different geometry, a block that is not whole tokens, or a
                pool already held with another geometry (``host_pool.<field>``).
            LayoutError: A main cache SFA cannot serve.
        """
        names = sorted(mains, key=layer_index)
        spans = {n: [tensor_span(n, t, layout) for t in mains[n]] for n in names}
        first = names[0] if names else ""
        blocks = {n: {t.shape[0] for t in mains[n]} for n in names}
        widths = {n: tuple(s.block_bytes // block_size for s in spans[n]) for n in names}
        for n in names:
            if any(s.block_bytes % block_size for s in spans[n]):
                raise ConfigError(
                    f"{n} block bytes", [s.block_bytes for s in spans[n]], f"whole tokens of block_size {block_size}"
                )
            if blocks[n] != blocks[first] or len(blocks[n]) != 1:
                raise ConfigError(f"{n} num_blocks", sorted(blocks[n]), f"{sorted(blocks[first])} (as {first})")
            if widths[n] != widths[first]:
                raise ConfigError(f"{n} token bytes", widths[n], f"{widths[first]} (as {first})")
        if not names:
            return {}
        major = all(
            _token_major(t, layout.axes_of(n, t.dim()), w)
            for n in names
            for t, w in zip(mains[n], widths[n], strict=True)
        )
        geometry = HostPoolGeometry(len(names), next(iter(blocks[first])), block_size, widths[first], major)
        rows = geometry.num_blocks * block_size
        runtime = get_runtime(self.device_index)
        if self._shared_pool is not None:  # registered again: one claim per worker
            release_host_pool(self.device_index, self._shared_pool)
            self._shared_pool = None

        def allocate() -> TensorHostPool:
            parts = [[runtime.pinned_empty((rows, w), torch.int8) for w in geometry.token_bytes] for _ in names]
            return TensorHostPool(geometry, parts)

        pool = claim_host_pool(
            self.device_index, geometry, allocate, f"SfaRemoteD2HConnector (D, device {self.device_index})"
        )
        self._shared_pool = pool
        views: dict[str, list[torch.Tensor]] = {}
        for layer, n in enumerate(names):
            views[n] = []
            for j, t in enumerate(mains[n]):
                view = pool.part(layer, j).view(-1).view(t.dtype).as_strided(t.shape, t.stride())
                if tensor_span(n, view, layout).block_bytes != spans[n][j].block_bytes:
                    raise ConfigError(f"{n} strides", tuple(t.stride()), "dense blocks the host pool can mirror")
                views[n].append(view)
        self.host_pool = views
        return views

    def _meta(self) -> ConsumerMetadata | ProducerMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SfaRemoteD2HMetadata):
            raise ConfigError("connector_metadata", type(meta).__name__, "SfaRemoteD2HMetadata")
        return meta.inner

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata and start the step before the forward (its layers are read as written).

        vLLM (0.32, 0.33) calls `start_load_kv` AFTER the forward when the step has no synchronous
        loads, by which time every layer of the step has been saved.
        """
        super().bind_connector_metadata(connector_metadata)
        if self._producer is not None or self._consumer is not None:
            self._start_step()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """The step was started when its metadata was bound (see `bind_connector_metadata`)."""
        self._start_step()

    def _start_step(self) -> None:
        """P: take this step's chunks. D: record new destinations. Once per bound metadata."""
        inner = self._meta()
        if inner is self._started:
            return
        self._started = inner
        if self._producer is not None and isinstance(inner, ProducerMetadata):
            self._producer.start_load_kv(inner)
        elif self._consumer is not None and isinstance(inner, ConsumerMetadata):
            self._consumer.start_load_kv(inner)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """P: the reuse gate (D finished reading what the last step dispatched). D: nothing."""
        if self._producer is not None:
            self._producer.wait_for_layer_load(layer_name)

    def _written_event(self) -> Callable[[], None] | None:
        """On a device: an event after the layer's KV write, waited for by the send thread. CPU: None."""
        return write_fence(self.device_index, self._sfa.read_timeout_s)

    def on_kv_cache_written(self, layer_name: str) -> None:
        """vllm-ascend's early hook right after the KV scatter: dispatch now, D's read overlaps attention."""
        if self._producer is not None and "indexer" not in layer_name:
            self._producer.on_kv_cache_written(layer_name, self._written_event())

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """P: the layer is written: tell D it may read it (unless `on_kv_cache_written` did)."""
        if self._producer is not None and "indexer" not in layer_name:
            self._producer.save_kv_layer(layer_name, self._written_event())

    def wait_for_save(self) -> None:
        """Nothing is saved synchronously (D reads asynchronously)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """D: requests every contributor finished (or failed after quarantine). P: nothing."""
        if self._consumer is None:
            return None, None
        _, recving = self._consumer.get_finished(finished_req_ids)
        return None, recving or None

    # get_transfer_results / get_block_ids_with_load_errors: the base's, over D's failures below.

    def _failed_recving(self, recving: set[str] | None) -> set[str]:
        return self._consumer.take_failed_recving() if self._consumer else set()

    def _load_error_blocks(self) -> set[int]:
        return self._consumer.get_block_ids_with_load_errors() if self._consumer else set()

    def shutdown(self) -> None:
        """Stop threads, sockets and registrations."""
        for part in (self._producer, self._consumer, self._metaserver):
            if part is not None:
                part.close() if isinstance(part, RetryingAnnouncer) else part.shutdown()
        if self._shared_pool is not None:  # after the consumer: no read lands in it any more
            release_host_pool(self.device_index, self._shared_pool)
            self._shared_pool = None
