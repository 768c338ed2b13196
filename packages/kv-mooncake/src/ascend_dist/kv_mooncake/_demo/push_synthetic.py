"""A synthetic layer-wise P or D instance: paged KV caches, a block allocator, the real scheduler and workers.

Runs in: the ``pd-layerwise`` scenario, the tests and the P child process
(`ascend_dist.kv_mooncake._demo.push_peer`). It hosts some or all TP ranks of one instance in this
process (P ranks that reshard over gloo live one per process). KV contents follow the pull
connector's `ascend_dist.kv_mooncake._demo.synthetic.pattern` of (seed, layer, part, global head,
position, element), so D verifies every pushed byte without seeing P's memory, including the
head -> token rearrangement of P_tp > D_tp.

P's "forward" runs layer by layer: reuse gate (``wait_for_layer_load``), a simulated compute delay,
the KV write, then ``save_kv_layer``; the push of layer ``i`` overlaps the compute of ``i + 1``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, TransferError
from ascend_dist.common.secret import DeploymentSecret, load_secret
from ascend_dist.kv_mooncake._demo.synthetic import Model, pattern
from ascend_dist.kv_mooncake._demo.synthetic_common import aggregate_ranks, wait_received
from ascend_dist.kv_mooncake._demo.synthetic_layouts import NATIVE_LAYOUTS, build_attention_caches
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, Writer, get_engine
from ascend_dist.kv_mooncake.core.kv_views import label_kv_caches
from ascend_dist.kv_mooncake.core.metaserver import Metaserver
from ascend_dist.kv_mooncake.core.ranks import head_range
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.reshard import AllToAll
from ascend_dist.kv_mooncake.push.scheduler import LayerwiseScheduler, Scheduled
from ascend_dist.kv_mooncake.push.worker import LayerwiseWorker

__all__ = ["CollectingMetaserver", "LwInstance"]


@dataclass
class CollectingMetaserver:
    """A `Metaserver` that keeps D's announcements in memory (the in-process proxy of the tests)."""

    posted: dict[str, dict[str, Any]] = field(default_factory=dict)
    fail_with: str = ""

    def post(self, url: str, payload: Mapping[str, Any]) -> None:
        """Record ``payload`` by request id (or fail, to exercise D's failure path)."""
        if self.fail_with:
            raise ConfigError("metaserver", url, self.fail_with)
        self.posted[str(payload["request_id"])] = dict(payload)

    def take(self, rid: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """Wait for and remove the announcement of ``rid``."""
        deadline = time.monotonic() + timeout_s
        while rid not in self.posted:
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"D did not announce {rid} within {timeout_s} s")
            time.sleep(0.001)
        return self.posted.pop(rid)


@dataclass
class _Rank:
    tp: int
    heads: tuple[int, int]
    caches: dict[str, tuple[torch.Tensor, ...]]
    worker: LayerwiseWorker


@dataclass
class LwInstance:
    """TP ranks of one P or D instance in this process, with the instance's scheduler."""

    config: LayerwiseConfig
    model: Model
    tp_ranks: Sequence[int] = ()
    engine: Writer | None = None
    all_to_all: AllToAll | None = None
    metaserver: Metaserver | None = None
    ranks: list[_Rank] = field(default_factory=list)
    secret: DeploymentSecret | None = field(default_factory=load_secret)  # as a deployment's nodes read it

    def __post_init__(self) -> None:
        m = self.model
        if self.engine is None:
            self.engine = get_engine(self.config.host, self.config.protocol)
        topo = self.config.prefill if self.config.is_producer else self.config.decode
        self.tp = topo.tp_size
        self.scheduler = LayerwiseScheduler(
            self.config, [m.block_size] * m.groups, metaserver=self.metaserver, secret=self.secret
        )
        self.free: list[list[int]] = [list(range(1, m.num_blocks)) for _ in range(m.groups)]
        self.blocks: dict[str, list[list[int]]] = {}
        self.requests: dict[str, SchedRequest] = {}
        self._seen: dict[str, int] = {}
        try:
            for tp in self.tp_ranks or range(self.tp):
                self.ranks.append(self._make_rank(tp))
        except BaseException:
            self.shutdown()
            raise

    def _make_rank(self, tp: int) -> _Rank:
        m = self.model
        first, count = (0, 1) if m.mla else head_range(tp, self.tp, m.heads)
        built = build_attention_caches(
            m.layout,
            [m.layer_name(i) for i in range(m.layers)],
            blocks=m.num_blocks,
            tokens=m.block_size,
            heads=count,
            dims=m.part_dims(),
            mla=m.mla,
        )
        native = m.layout in NATIVE_LAYOUTS
        parts, layout = label_kv_caches(built.raw, native=native, layout_name=m.layout if native else "")
        caches = built.rows  # [blocks, tokens, heads, dim] views, whatever the storage order
        worker = LayerwiseWorker(
            self.config,
            tp_rank=tp,
            num_kv_heads=m.heads,
            use_mla=m.mla,
            engine=self.engine,
            all_to_all=self.all_to_all,
        )
        groups = [[m.layer_name(i) for i in range(m.layers) if i % m.groups == g] for g in range(m.groups)]
        worker.register_kv_caches(parts, groups=groups, num_blocks=m.num_blocks, block_size=m.block_size, layout=layout)
        return _Rank(tp, (first, count), caches, worker)

    def _alloc(self, rid: str, tokens: int) -> list[list[int]]:
        n = -(-tokens // self.model.block_size)
        if any(len(f) < n for f in self.free):
            raise ConfigError("num_blocks", self.model.num_blocks, f"enough free blocks for {n} more")
        ids = [[f.pop(0) for _ in range(n)] for f in self.free]
        self.blocks[rid] = ids
        return ids

    def release(self, rid: str) -> None:
        """Return a request's blocks to the free lists."""
        for free, ids in zip(self.free, self.blocks.pop(rid, []), strict=False):
            free.extend(ids)
        self.requests.pop(rid, None)

    # ---- D ---------------------------------------------------------------------------------------

    def announce(
        self, rid: str, prompt_len: int, computed_tokens: int = 0, url: str = "http://proxy/v1/metaserver"
    ) -> int:
        """D: match, allocate the whole prompt, announce, start waiting; returns the tokens to load."""
        req = SchedRequest(rid, prompt_len, {"do_remote_prefill": True, "metaserver": url})
        self.requests[rid] = req
        count, _ = self.scheduler.get_num_new_matched_tokens(req, computed_tokens)
        ids = self._alloc(rid, prompt_len)
        self.scheduler.update_state_after_alloc(req, ids, count)
        self.step()
        return count

    def step(self, scheduled: Mapping[str, Scheduled] | None = None) -> None:
        """Build this step's metadata and hand it to every rank."""
        meta = self.scheduler.build_connector_meta(scheduled)
        for r in self.ranks:
            r.worker.start_load_kv(meta)

    def poll(self) -> tuple[set[str], set[int]]:
        """D: ``(finished_recving, load-error block ids)`` aggregated over ranks (as vLLM does)."""
        errors: set[int] = set()
        reports: list[set[str]] = []
        for r in self.ranks:
            reports.append(r.worker.get_finished()[1])
            errors |= r.worker.get_block_ids_with_load_errors()
        return aggregate_ranks(self._seen, reports, len(self.ranks)), errors

    def wait_recv(self, rids: set[str], timeout_s: float) -> set[int]:
        """D: poll until every request finished receiving (or failed); return the load errors."""
        return wait_received(self.poll, rids, timeout_s)

    def verify(self, rid: str, seed: int, computed_tokens: int = 0) -> int:
        """D: compare every pushed byte of a request with P's pattern; return the bytes checked."""
        m = self.model
        first_block = computed_tokens // m.block_size
        checked = 0
        for r in self.ranks:
            heads = torch.arange(r.heads[0], r.heads[0] + r.heads[1])
            for i in range(m.layers):
                ids = self.blocks[rid][i % m.groups][first_block:]
                pos = (first_block + torch.arange(len(ids)))[:, None] * m.block_size + torch.arange(m.block_size)
                for part, t in enumerate(r.caches[m.layer_name(i)]):
                    got = t[torch.tensor(ids)]
                    if not torch.equal(got, pattern(seed, i, part, heads, pos, dim=t.shape[3])):
                        raise AssertionError(f"{rid}: layer {i} part {part} rank tp{r.tp} differs from P's bytes")
                    checked += got.numel() * got.element_size()
        return checked

    def recompute(self, rid: str, seed: int) -> None:
        """D: write the request's blocks itself, as vLLM's recompute of a failed load does (pattern of ``seed``)."""
        for i in range(self.model.layers):
            self._write_layer(rid, seed, i)

    def finish(self, rid: str) -> None:
        """The request finished (either side): forget it and free its blocks."""
        req = self.requests.get(rid)
        if req is not None:
            self.scheduler.request_finished(req, self.blocks.get(rid, []))
        self.release(rid)

    # ---- P ---------------------------------------------------------------------------------------

    def prefill(
        self,
        params: Mapping[str, Any],
        prompt_len: int,
        seed: int,
        *,
        compute_s: float = 0.0,
        chunks: int = 1,
        kv_in_forward: bool = True,
        abort_after: int = 0,
        pause_s: float = 0.0,
    ) -> tuple[float, float]:
        """P: run the prompt's forward layer by layer (in ``chunks`` steps), pushing each layer; free at the end.

        Args:
            params: The proxy's ``kv_transfer_params`` (D's announcement).
            prompt_len: Prompt tokens.
            seed: Pattern seed of the KV contents.
            compute_s: Simulated compute per layer.
            chunks: Prefill steps.
            kv_in_forward: Write each layer's KV inside the forward (after its reuse gate); False
                writes every layer before the timed forward (the bench: then the forward costs only
                ``compute_s`` per layer).
            abort_after: When > 0, the request ends on P (client abort, stop) after this many
                steps, before its last chunk: P frees it and never schedules it again.
            pause_s: An extra stall of each step's forward after its first layer was saved (a
                slow step: D's ``layer_timeout_s`` may pass before the next layer).

        Returns:
            ``(start, seconds)``: `time.monotonic` at the first layer (comparable across processes
            on one host) and the time to the last ``save_kv_layer`` returning.
        """
        rid = str(params["request_id"])
        req = SchedRequest(rid, prompt_len, {**params, "do_remote_decode": True})
        self.requests[rid] = req
        ids = self._alloc(rid, prompt_len)
        self.scheduler.update_state_after_alloc(req, ids, 0)
        if not kv_in_forward:
            self.wait_idle()
            for i in range(self.model.layers):
                self._write_layer(rid, seed, i)
        per_chunk = -(-prompt_len // chunks)
        start, begin = time.monotonic(), time.perf_counter()
        for n, done in enumerate(range(0, prompt_len, per_chunk)):
            if abort_after and n == abort_after:
                break
            self.step({rid: Scheduled(done, min(per_chunk, prompt_len - done))})
            self.forward(rid, seed, compute_s, write=kv_in_forward, pause_s=pause_s)
        elapsed = time.perf_counter() - begin
        self.finish(rid)  # P frees at once; the reuse gate protects layers still in flight
        if abort_after:
            self.step({})  # vLLM schedules one more step to tell the workers what finished
        return start, elapsed

    def compute_only(self, compute_s: float) -> float:
        """P (bench): the forward's simulated compute alone (``compute_s`` per layer, no push); seconds."""
        start = time.perf_counter()
        for _ in range(self.model.layers):
            time.sleep(compute_s)
        return time.perf_counter() - start

    def raw_push(self, params: Mapping[str, Any], prompt_len: int) -> float:
        """P (bench baseline): the same writes as a request's push, one raw engine call per layer, no compute.

        Returns:
            Seconds for all layers' ``batch_transfer_sync_write`` calls, back to back.

        Raises:
            TransferError: An engine call failed.
        """
        rid = str(params["request_id"])
        req = SchedRequest(rid, prompt_len, {**params, "do_remote_decode": True})
        self.requests[rid] = req
        ids = self._alloc(rid, prompt_len)
        self.scheduler.update_state_after_alloc(req, ids, 0)
        self.step({rid: Scheduled(0, prompt_len)})
        worker = self.ranks[0].worker
        batches = [b for name in self.ranks[0].caches for b in worker.layer_batches(name)]
        engine = self.engine
        if not isinstance(engine, MooncakeEngine):
            raise ConfigError("engine", type(engine).__name__, "a MooncakeEngine (raw_write) for the baseline")
        start = time.perf_counter()
        for session, batch in batches:
            rc = engine.raw_write(session, batch)
            if rc != 0:
                raise TransferError(f"raw batch_transfer_sync_write returned {rc}", peer=session)
        elapsed = time.perf_counter() - start
        self.step({})
        self.finish(rid)
        return elapsed

    def forward(self, rid: str, seed: int, compute_s: float, *, write: bool = True, pause_s: float = 0.0) -> None:
        """One forward over every layer: reuse gate, compute delay, KV write, save."""
        for i in range(self.model.layers):
            name = self.model.layer_name(i)
            for r in self.ranks:
                r.worker.wait_for_layer_load(name)
            if compute_s:
                time.sleep(compute_s)
            if write:
                self._write_layer(rid, seed, i)
            for r in self.ranks:
                r.worker.save_kv_layer(name)
            if i == 0 and pause_s:
                time.sleep(pause_s)

    def _write_layer(self, rid: str, seed: int, layer: int) -> None:
        m = self.model
        ids = self.blocks[rid][layer % m.groups]
        pos = torch.arange(len(ids))[:, None] * m.block_size + torch.arange(m.block_size)
        index = torch.tensor(ids)
        for r in self.ranks:
            heads = torch.arange(r.heads[0], r.heads[0] + r.heads[1])
            for part, t in enumerate(r.caches[m.layer_name(layer)]):
                t[index] = pattern(seed, layer, part, heads, pos, dim=t.shape[3])

    def held(self) -> dict[str, int]:
        """P: what the instance still holds: scheduler entries, blocks, remembered failures and claims, closed gates."""
        failed = pending = claims = 0
        for r in self.ranks:
            producer = r.worker._producer
            if producer is not None:
                failed += producer.sender.failures_kept
                claims += producer.sender.claims_kept
                pending += sum(producer.gate.pending(i) for i in range(len(r.caches)))
        blocks = sum(len(i) for per in self.blocks.values() for i in per)
        tracked = self.scheduler.tracked
        return {
            "tracked": tracked,
            "blocks_held": blocks,
            "failed_kept": failed,
            "claims_kept": claims,
            "gates_closed": pending,
        }

    def wait_idle(self) -> None:
        """P: wait until every layer's push finished (all reuse gates open; bounded by ``gate_timeout_s``)."""
        for r in self.ranks:
            for name in r.caches:
                r.worker.wait_for_layer_load(name)

    def shutdown(self) -> None:
        """Stop every worker and the scheduler's threads."""
        for r in self.ranks:
            r.worker.shutdown()
        self.scheduler.close()
