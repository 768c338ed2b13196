"""P's per-step planning and per-layer save path of the layer-wise push.

Runs in: P worker processes, on the model-runner thread (`LayerwiseWorker` delegates to it).
``plan_step`` first waits until every layer queued in earlier steps was pushed (vLLM writes a
layer's KV before the connector's per-layer gate, so a step must not start writing while older
pushes still read its blocks), then turns the step's `SendReqMeta` list into `RequestPlan`s
(fetching each D endpoint's metadata once, again when a request names another engine id: a D
restarted on its ports; a D that refuses or does not answer fails that request only);
``save_kv_layer`` closes the layer's reuse gate and queues its writes to the `SendThread`.
With ``pd_head_ratio > 1`` it first gathers the layer's blocks and runs the all-to-all into a
registered staging slot (a collective: every member calls it for the same layer, which the shared
scheduler output ensures).
Head-major blocks (``[heads][tokens]``, vLLM's HND layouts) need no exchange: each P rank's whole
block is one run of D's block, at its heads' offset, and is written from the cache directly.
"""

from __future__ import annotations

import logging
import queue
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ascend_dist.common.errors import (
    AscendDistError,
    BlockIdError,
    ConfigError,
    DeadlineExceeded,
    IncompatiblePeer,
    LayoutError,
)
from ascend_dist.common.regions import RegisterRegions, collect_storage_merged_register_regions
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.device_fence import Fence
from ascend_dist.kv_mooncake.core.mappings import ParallelInfo
from ascend_dist.kv_mooncake.core.messages import TensorMeta
from ascend_dist.kv_mooncake.core.transfer_mappings import Endpoint
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.gate import ReuseGate
from ascend_dist.kv_mooncake.push.plan import (
    RequestPlan,
    a2a_member_index,
    as_descriptors,
    block_runs,
    plain_pieces,
    plan_request,
    rearranged_positions,
)
from ascend_dist.kv_mooncake.push.reshard import AllToAll, chunk_major, rearrange_output
from ascend_dist.kv_mooncake.push.sender import MetaCache, SendTask, SendThread, WriteItem
from ascend_dist.kv_mooncake.push.step_metadata import SendReqMeta

__all__ = ["LayerTable", "Producer"]

logger = logging.getLogger(__name__)

STAGING_SLOTS = 2
OPEN_MEMORY = 65536  # unfinished requests whose D endpoints a rank remembers (for an early end)


@dataclass(frozen=True)
class LayerTable:
    """The registered layers of one worker, in index order.

    ``tensors`` are ``[blocks, tokens, heads, dim]`` views of the registered tensors (whatever their
    storage order); ``metas`` their block geometry.
    """

    names: Sequence[str]
    group_of: Mapping[str, int]
    tensors: Mapping[str, Sequence[torch.Tensor]]
    metas: Mapping[str, Sequence[TensorMeta]]
    block_size: int

    def index(self, layer_name: str) -> int:
        """The layer's index.

        Raises:
            ConfigError: Not a registered layer.
        """
        try:
            return list(self.names).index(layer_name)
        except ValueError:
            raise ConfigError("layer_name", layer_name, f"a registered layer ({len(self.names)} layers)") from None


class Producer:
    """P's side of one worker: the step's plans, the reuse gate, the staging slots and the send thread."""

    def __init__(
        self,
        config: LayerwiseConfig,
        layers: LayerTable,
        *,
        tp_rank: int,
        pcp_rank: int,
        heads: int,
        use_mla: bool,
        p: ParallelInfo,
        all_to_all: AllToAll | None,
        metas: MetaCache,
        make_sender: Callable[[ReuseGate], SendThread],
        register: Callable[[RegisterRegions], None],
    ) -> None:
        """Create the gate, the staging slots (resharding) and start the send thread."""
        self._config, self._layers = config, layers
        self._tp_rank, self._pcp_rank, self._heads, self._use_mla = tp_rank, pcp_rank, heads, use_mla
        self._p, self._ratio, self._a2a = p, p.pd_head_ratio, all_to_all
        self._meta_cache = metas
        self._staging: list[list[torch.Tensor]] = []
        self._free_slots: queue.Queue[int] = queue.Queue()
        self._step: list[tuple[SendReqMeta, RequestPlan]] = []
        # Requests planned whose last chunk has not been planned yet: who waits for their Done.
        self._open: OrderedDict[str, tuple[tuple[Endpoint, int], ...]] = OrderedDict()
        if self._ratio > 1 and not all(self._direct(n) for n in layers.names):
            self._make_staging(register)
        slots = {i: [t.data_ptr() for t in layers.tensors[n]] for i, n in enumerate(layers.names)}
        self._sender: SendThread | None = None
        self.gate = ReuseGate(slots, alive=lambda: self._sender is not None and self._sender.alive)
        self._sender = make_sender(self.gate)

    def _direct(self, layer_name: str) -> bool:
        """Head-major layer: with ``pd_head_ratio > 1`` P's own blocks are D's head slices, no all-to-all."""
        metas = self._layers.metas[layer_name]
        return bool(metas) and all(m.head_major for m in metas)

    @property
    def sender(self) -> SendThread:
        """The send thread."""
        assert self._sender is not None
        return self._sender

    def plan_step(self, send: Sequence[SendReqMeta], ended: Sequence[str] = ()) -> None:
        """Wait until every queued layer was pushed, then plan this step's writes (replacing the last step's).

        ``ended``: requests that ended on P before their last chunk; each D this rank wrote them to
        gets a failed `PushDone` (queued after their written layers, so it follows their notices).

        vLLM writes a layer's KV (``unified_kv_cache_update``) BEFORE it calls ``wait_for_layer_load``,
        so the reuse gate waited on there comes too late for blocks freed and reallocated since the
        previous step: the step's first cache update could overwrite blocks a queued push has not
        read yet, and D would receive the new request's bytes. Every push of earlier steps must
        have read its blocks before this step's forward writes any.

        Raises:
            DeadlineExceeded: A queued layer was still being pushed after ``gate_timeout_s``.
            TransferError: The send thread died with layers queued.
        """
        self.gate.wait_all(self._config.gate_timeout_s)
        for tid in ended:
            done_to = self._open.pop(tid, None)
            if done_to:
                self.sender.end(tid, done_to, "the request ended on P before its last chunk was pushed")
        self._step = []
        for idx, req in enumerate(send):
            plan = self._plan(idx, req)
            if plan is not None:
                self._step.append((req, plan))
                self._track(plan)
        # D's fence: claim every request this rank writes in this step before the first write; D
        # answers the ones it gave up on (their blocks may be recomputed) and those are not written.
        claims: dict[Endpoint, list[str]] = {}
        for _, plan in self._step:
            for endpoint in dict.fromkeys(t.endpoint for t in plan.tasks):
                if self.sender.failure(plan.transfer_id) is None:
                    claims.setdefault(endpoint, []).append(plan.transfer_id)
        for endpoint, ids in claims.items():
            self.sender.claim(endpoint, ids)

    def _track(self, plan: RequestPlan) -> None:
        """Remember who waits for an unfinished request's Done; forget it with its last chunk."""
        if plan.chunk_finished:
            self._open.pop(plan.transfer_id, None)
            return
        self._open[plan.transfer_id] = plan.done_to
        self._open.move_to_end(plan.transfer_id)
        while len(self._open) > OPEN_MEMORY:  # bounded: a request vLLM never finishes nor ends
            self._open.popitem(last=False)

    def _plan(self, idx: int, req: SendReqMeta) -> RequestPlan | None:
        prm = req.params
        try:
            d = ParallelInfo(prm.remote_tp_size, prm.remote_pcp_size, prm.remote_dcp_size, self._use_mla, 1)
            plan = plan_request(
                transfer_id=prm.request_id,
                req_idx=idx,
                p=self._p,
                d=d,
                tp_rank=self._tp_rank,
                pcp_rank=self._pcp_rank,
                num_heads=self._heads,
                block_size=self._layers.block_size,
                local_block_ids=req.local_block_ids,
                remote_block_ids=prm.remote_block_ids,
                d_host=prm.remote_host,
                d_base_port=prm.remote_port,
                prompt_len=req.prompt_len,
                computed_tokens=req.computed_tokens,
                transed_tokens=req.transed_tokens,
                remote_cached_tokens=prm.remote_cached_tokens,
                chunk_finished=req.chunk_finished,
            )
        except AscendDistError as exc:
            logger.error("request %s: cannot plan the push: %s", prm.request_id, exc)
            return None
        for endpoint in {t.endpoint for t in plan.tasks}:
            try:
                agent = self._meta_cache.get(endpoint, prm.remote_engine_id)  # fetched again if restarted
                if agent.engine_id != prm.remote_engine_id:
                    # Host and port come from the params unsigned: the D answering there must be the
                    # one whose blocks these are, or another D's live request of the same id is written.
                    raise IncompatiblePeer("remote_engine_id", prm.remote_engine_id, agent.engine_id)
                top = max((b for t in plan.tasks if t.endpoint == endpoint for b in t.remote_block_ids), default=-1)
                if top >= agent.num_blocks:
                    raise BlockIdError("remote_block_ids", top, f"ids below D's num_blocks={agent.num_blocks}")
            except AscendDistError as exc:
                self.sender.mark_failed(prm.request_id, f"D {endpoint.host}:{endpoint.port}: {exc}")
        return plan

    def save_kv_layer(self, layer_name: str, fence: Fence | None = None) -> None:
        """P: queue the layer's writes for this step's requests (``fence``: see `LayerwiseWorker.save_kv_layer`).

        Raises:
            DeadlineExceeded: No staging slot became free within ``gate_timeout_s`` (resharding).
            TransferError: The send thread is not running.
        """
        if not self._step:
            return
        idx = self._layers.index(layer_name)
        group = self._layers.group_of[layer_name]
        task = SendTask(layer=idx)
        tasks = [(t, plan) for _, plan in self._step for t in plan.tasks if t.group == group]
        staging: list[int] = []
        positions: dict[int, int] = {}
        if self._ratio > 1 and tasks and not self._direct(layer_name):
            slot, staging, positions = self._reshard(
                layer_name, sorted({b for t, _ in tasks for b in t.local_block_ids})
            )
            task.release = lambda: self._free_slots.put(slot)
        member = a2a_member_index(self._tp_rank, self._p, self._heads)
        for t, _ in tasks:
            if self.sender.failure(t.transfer_id) is not None:
                continue
            try:
                agent = self._meta_cache.get(t.endpoint)
                remote = agent.layers[layer_name]
            except (AscendDistError, KeyError) as exc:
                self.sender.mark_failed(t.transfer_id, f"D metadata for {layer_name}: {exc!r}")
                continue
            local_ids = [positions[b] for b in t.local_block_ids] if staging else list(t.local_block_ids)
            task.items.append(
                WriteItem(
                    t.transfer_id,
                    t.endpoint,
                    agent.te_session,
                    self._layers.metas[layer_name],
                    remote,
                    local_ids,
                    t.remote_block_ids,
                    t.trans_count,
                    staging,
                    member,
                    self._ratio,
                )
            )
        if idx == len(self._layers.names) - 1:
            task.finished = [(plan.transfer_id, plan.done_to) for _, plan in self._step if plan.chunk_finished]
        task.ready = fence() if fence is not None else None  # after the reshard's device work too
        self.gate.mark_pending(idx)
        self.sender.submit(task, self._config.gate_timeout_s)

    def _reshard(self, layer_name: str, union: list[int]) -> tuple[int, list[int], dict[int, int]]:
        """Gather ``union`` blocks of each tensor, exchange over the group, store into a staging slot."""
        assert self._a2a is not None
        try:
            slot = self._free_slots.get(timeout=self._config.gate_timeout_s)
        except queue.Empty:
            raise DeadlineExceeded(f"no staging slot free within {self._config.gate_timeout_s} s") from None
        idx = torch.tensor(union, dtype=torch.long)
        bases = []
        for c, view in enumerate(self._layers.tensors[layer_name]):
            _, b, h, dim = view.shape
            gathered = view.index_select(0, idx).reshape(len(union) * b, h, dim)
            out = rearrange_output(self._a2a.exchange(chunk_major(gathered, self._ratio, b)), self._ratio, h)
            buf = self._staging[slot][c]
            if out.numel() > buf.numel():
                raise LayoutError("staging", buf.numel(), f"room for {out.numel()} elements of {layer_name}")
            buf[: out.numel()].copy_(out.reshape(-1))
            bases.append(buf.data_ptr())
        return slot, bases, {b: p for b, p in zip(union, rearranged_positions(union, union), strict=True)}

    def layer_batches(self, layer_name: str) -> list[tuple[str, Descriptors]]:
        """The plain-path writes of one layer for this step's requests, per D session (bench baseline).

        Raises:
            ConfigError: Resharding is active (the baseline covers the plain path only).
        """
        if self._ratio > 1:
            raise ConfigError("pd_head_ratio", self._ratio, "1 for the raw-engine baseline")
        group = self._layers.group_of[layer_name]
        out: dict[str, list[Descriptors]] = {}
        for _, plan in self._step:
            for t in plan.tasks:
                if t.group == group:
                    agent = self._meta_cache.get(t.endpoint)
                    runs = block_runs(t.local_block_ids, t.remote_block_ids)
                    batch = as_descriptors(plain_pieces(self._layers.metas[layer_name], agent.layers[layer_name], runs))
                    out.setdefault(agent.te_session, []).append(batch)
        return [(session, Descriptors.concat(parts)) for session, parts in out.items()]

    def _make_staging(self, register: Callable[[RegisterRegions], None]) -> None:
        """Registered staging buffers: slots x tensors, each as large as one layer's tensor."""
        first = self._layers.tensors[self._layers.names[0]]
        for slot in range(STAGING_SLOTS):
            self._staging.append([torch.empty(t.numel(), dtype=t.dtype) for t in first])
            self._free_slots.put(slot)
        register(collect_storage_merged_register_regions(self._staging))

    def close(self) -> None:
        """Finish queued layers and join the send thread."""
        if self._sender is not None:
            self._sender.close()
