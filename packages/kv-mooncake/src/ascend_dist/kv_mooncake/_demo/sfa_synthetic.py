"""Synthetic SFA P and D instances: paged MLA + indexer caches, block allocators, the real halves.

Runs in: the ``pd-sfa`` scenario, the tests and the P child process (`ascend_dist.kv_mooncake._demo.sfa_peer`).
All TP ranks of an instance live in one process and share its Mooncake engine; P and D are
separate processes. Contents are a deterministic function of (seed, layer, part, token position,
element), so D verifies every byte without seeing P's memory. P frees a request's blocks as soon
as its prefill is dispatched and hands them to the next request: only the reuse gates keep the
next request's writes away from blocks D is still reading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import load_secret
from ascend_dist.kv_mooncake._demo.synthetic_common import aggregate_ranks, wait_received
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, Reader
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.consumer import ConsumerWorker
from ascend_dist.kv_mooncake.sfa.messages import ContactInfo
from ascend_dist.kv_mooncake.sfa.plan import DestLayer, GroupIds
from ascend_dist.kv_mooncake.sfa.producer import ProducerWorker, tensor_span
from ascend_dist.kv_mooncake.sfa.scheduler import (
    ConsumerScheduler,
    ProducerScheduler,
    SfaRequest,
    StepRequest,
)

__all__ = ["ContactLog", "Job", "SfaDInstance", "SfaModel", "SfaPInstance", "sfa_pattern"]


@dataclass(frozen=True)
class SfaModel:
    """Shape of the synthetic SFA model (int16 elements).

    Attributes:
        layers: Transformer layers.
        block_size: Tokens per block (main and indexer).
        num_blocks: Blocks per tensor.
        main_dims: Widths of the two main MLA tensors (nope, rope).
        indexer_dims: Widths of the indexer tensors (k, optionally a scale); empty: no indexer.
    """

    layers: int = 4
    block_size: int = 16
    num_blocks: int = 64
    main_dims: tuple[int, int] = (64, 8)
    indexer_dims: tuple[int, ...] = (16,)

    def main_name(self, i: int) -> str:
        """vLLM-style name of layer i's main cache."""
        return f"model.layers.{i}.self_attn.attn"

    def indexer_name(self, i: int) -> str:
        """vLLM-style name of layer i's indexer cache."""
        return f"model.layers.{i}.self_attn.indexer.k_cache"

    @property
    def groups(self) -> GroupIds:
        """Main group 0, indexer group 1 (or 0 without an indexer)."""
        return GroupIds(0, 1 if self.indexer_dims else 0)


def sfa_pattern(seed: int, layer: int, part: int, positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Expected int16 rows ``[len(positions), dim]``."""
    d = torch.arange(dim, dtype=torch.int64)
    v = seed * 1_000_003 + layer * 7_919 + part * 104_729 + positions[:, None] * 15_485_863 + d[None, :]
    return (v % 32_749).to(torch.int16)


def _blocks(model: SfaModel, dim: int) -> torch.Tensor:
    return torch.zeros(model.num_blocks, model.block_size, dim, dtype=torch.int16)


class ContactLog:
    """A `ContactSink` that keeps what D posted (the scenario's proxy reads it)."""

    def __init__(self) -> None:
        """Start empty."""
        self.posted: dict[str, ContactInfo] = {}
        self.cancelled: set[str] = set()

    def post(self, ext_id: str, contact: ContactInfo, url: str | None = None) -> None:
        """Keep the contact info."""
        self.posted[ext_id] = contact

    def cancel(self, ext_id: str) -> None:
        """Remember the cancellation."""
        self.cancelled.add(ext_id)


@dataclass(frozen=True)
class Job:
    """One prefill of the synthetic P: request id, prompt, pattern seed, D's contact params, chunk."""

    rid: str
    prompt_len: int
    seed: int
    params: dict[str, Any]
    chunk: int = 0


@dataclass
class _Alloc:
    free: list[list[int]]
    held: dict[str, list[list[int]]] = field(default_factory=dict)

    def take(self, rid: str, group: int, n: int) -> list[int]:
        if len(self.free[group]) < n:
            raise ConfigError("num_blocks", len(self.free[group]), f"{n} more free blocks")
        ids = [self.free[group].pop(0) for _ in range(n)]
        self.held.setdefault(rid, [[] for _ in self.free])[group].extend(ids)
        return ids

    def release(self, rid: str) -> None:
        for group, ids in enumerate(self.held.pop(rid, [])):
            self.free[group][:0] = ids  # reused first: the gates must protect them


def _write(t: torch.Tensor, ids: list[int], positions: torch.Tensor, rows: torch.Tensor, bs: int) -> None:
    blk = torch.tensor(ids, dtype=torch.long)[positions // bs]
    t[blk, positions % bs] = rows


class SfaPInstance:
    """A producer instance: every TP rank's caches and workers, one scheduler."""

    def __init__(self, config: SfaConfig, model: SfaModel, engine: MooncakeEngine) -> None:
        """Allocate caches, register them, create the workers."""
        self.config, self.model = config, model
        self.scheduler = ProducerScheduler(config, [model.block_size] * 2, model.groups, secret=load_secret())
        self.alloc = _Alloc([list(range(1, model.num_blocks)) for _ in range(2)])
        self.caches: list[dict[str, tuple[torch.Tensor, ...]]] = []
        self.workers: list[ProducerWorker] = []
        for rank in range(config.prefill.tp_size):
            caches: dict[str, tuple[torch.Tensor, ...]] = {}
            for i in range(model.layers):
                caches[model.main_name(i)] = tuple(_blocks(model, d) for d in model.main_dims)
                if model.indexer_dims:
                    caches[model.indexer_name(i)] = tuple(_blocks(model, d) for d in model.indexer_dims)
            worker = ProducerWorker(config, tp_rank=rank, backend=engine)
            worker.register_kv_caches(caches, block_size=model.block_size)
            self.caches.append(caches)
            self.workers.append(worker)

    def prefill(
        self, rid: str, prompt_len: int, seed: int, params: dict[str, Any], chunk: int = 0, *, fill: bool = True
    ) -> int:
        """Run one request's (chunked) prefill and free its blocks; returns the steps run."""
        return self.prefill_batch([Job(rid, prompt_len, seed, params, chunk)], fill=fill)

    def prefill_batch(self, jobs: list[Job], *, fill: bool = True) -> int:
        """Prefill requests together (one forward per step, as vLLM batches them); returns the steps.

        Each request's blocks are freed as soon as its prompt is done (P's ``request_finished``).
        ``fill=False`` skips writing the pattern (a zero-compute prefill for the benchmark).
        """
        m = self.model
        reqs = {
            j.rid: SfaRequest(j.rid, str(j.params.get("request_id", j.rid)), j.prompt_len, dict(j.params)) for j in jobs
        }
        for req in reqs.values():
            self.scheduler.update_state_after_alloc(req)
        computed = dict.fromkeys(reqs, 0)
        steps = 0
        while any(computed[j.rid] < j.prompt_len for j in jobs):
            batch: list[StepRequest] = []
            writes: list[tuple[Job, torch.Tensor]] = []
            for j in jobs:
                done = computed[j.rid]
                if done >= j.prompt_len:
                    continue
                n = min(j.chunk or j.prompt_len, j.prompt_len - done)
                have = -(-done // m.block_size)
                need = -(-(done + n) // m.block_size) - have
                new = [self.alloc.take(j.rid, g, need) for g in range(2)]
                batch.append(StepRequest(j.rid, done, n, (tuple(new[0]), tuple(new[1])), is_new=done == 0))
                writes.append((j, torch.arange(done, done + n)))
                computed[j.rid] = done + n
            meta = self.scheduler.build_connector_meta(batch)
            for w in self.workers:
                w.start_load_kv(meta)
            self._forward(writes, fill)
            steps += 1
            for j, _ in writes:
                if computed[j.rid] >= j.prompt_len:
                    self.scheduler.request_finished(reqs[j.rid])
                    self.alloc.release(j.rid)
        return steps

    def _forward(self, writes: list[tuple[Job, torch.Tensor]], fill: bool) -> None:
        m = self.model
        for i in range(m.layers):
            for w, caches in zip(self.workers, self.caches, strict=True):
                names = ([m.indexer_name(i)] if m.indexer_dims else []) + [m.main_name(i)]
                for name in names:
                    w.wait_for_layer_load(name)  # the reuse gate: D finished the previous step's read
                    base = 2 if "indexer" in name else 0
                    for j, positions in writes if fill else ():
                        ids = self.alloc.held[j.rid][1 if base else 0]
                        for part, t in enumerate(caches[name]):
                            rows = sfa_pattern(j.seed, i, base + part, positions, t.shape[2])
                            _write(t, ids, positions, rows, m.block_size)
                w.save_kv_layer(m.main_name(i))

    def failed(self) -> dict[str, str]:
        """Requests whose reads failed on any rank since the last call."""
        out: dict[str, str] = {}
        for w in self.workers:
            out.update(w.take_failed())
        return out

    def held(self) -> dict[str, int]:
        """What P holds between requests (the leak test's counters): none of it may grow with requests."""
        ds = [w.dispatcher for w in self.workers]
        return {
            "tracked": self.scheduler.tracked,
            "blocks_held": len(self.alloc.held),
            "failed_kept": sum(d.failures_kept for d in ds),
            "voided": sum(d.voided for d in ds),
            "links": sum(d.links for d in ds),
        }

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every rank's gates are open (D answered everything dispatched)."""
        for w, caches in zip(self.workers, self.caches, strict=True):
            for name in caches:
                w.wait_for_layer_load(name)

    def shutdown(self) -> None:
        """Stop every worker."""
        for w in self.workers:
            w.shutdown()


class SfaDInstance:
    """A consumer instance: the shared host pool, per-rank indexer caches, workers, one scheduler."""

    def __init__(self, config: SfaConfig, model: SfaModel, engine: Reader) -> None:
        """Allocate the pool and caches, register them, start every rank's read thread."""
        self.config, self.model = config, model
        self.sink = ContactLog()
        self.scheduler = ConsumerScheduler(
            config, [model.block_size] * 2, model.groups, self.sink, secret=load_secret()
        )
        self.alloc = _Alloc([list(range(1, model.num_blocks)) for _ in range(2)])
        self.pool = {model.main_name(i): tuple(_blocks(model, d) for d in model.main_dims) for i in range(model.layers)}
        self.indexers: list[dict[str, tuple[torch.Tensor, ...]]] = []
        self.workers: list[ConsumerWorker] = []
        self.prompts: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        self._aborted: set[str] = set()  # handed to the workers' next get_finished, as vLLM's finished_req_ids
        pool_regions = [(t.data_ptr(), t.numel() * t.element_size()) for ts in self.pool.values() for t in ts]
        for rank in range(config.decode.tp_size):
            idx = {
                model.main_name(i): tuple(_blocks(model, d) for d in model.indexer_dims) for i in range(model.layers)
            }
            dest = {}
            for name, main in self.pool.items():
                spans = [tensor_span(name, t) for t in main]
                ispans = [tensor_span(name, t) for t in idx[name]]
                dest[name] = DestLayer(
                    tuple(s.base for s in spans),
                    tuple(s.block_bytes for s in spans),
                    tuple(s.base for s in ispans),
                    tuple(s.block_bytes for s in ispans),
                )
            regions = pool_regions + [(t.data_ptr(), t.numel() * t.element_size()) for ts in idx.values() for t in ts]
            worker = ConsumerWorker(config, tp_rank=rank, backend=engine)
            try:
                worker.register(dest, regions)
            except BaseException:  # the ranks started so far stop and unregister too
                self.shutdown()
                raise
            self.indexers.append(idx)
            self.workers.append(worker)

    def decode(self, rid: str, prompt_len: int, computed: int = 0, *, deliver: bool = True) -> dict[str, Any]:
        """Allocate a remote-prefill request and return the contact params for P.

        With ``deliver=False`` the workers get the destinations only at the next `step` (P may
        then be faster than D's own step: the read thread waits ``dest_wait_s`` for them).
        """
        m = self.model
        req = SfaRequest(rid, rid, prompt_len, {"do_remote_prefill": True})
        count, _ = self.scheduler.get_num_new_matched_tokens(req, computed)
        n = -(-prompt_len // m.block_size)
        ids = [self.alloc.take(rid, g, n) for g in range(2)]
        contact = self.scheduler.update_state_after_alloc(req, ids, count, computed)
        if contact is None:
            raise ConfigError("prompt_len", prompt_len, f"more than the {computed} computed tokens")
        self.prompts[rid] = prompt_len
        if deliver:
            self.step()
        return msgspec.to_builtins(contact)

    def step(self) -> None:
        """One scheduler step: hand newly allocated requests to the workers."""
        meta = self.scheduler.build_connector_meta()
        for w in self.workers:
            w.start_load_kv(meta)

    def poll(self) -> tuple[set[str], set[int]]:
        """Requests every rank reported finished (as vLLM aggregates), and the load errors seen."""
        errors: set[int] = set()
        reports: list[set[str]] = []
        aborted, self._aborted = self._aborted, set()
        for w in self.workers:
            errors |= w.get_block_ids_with_load_errors()
            reports.append(w.get_finished(aborted)[1])
        return aggregate_ranks(self._seen, reports, len(self.workers)), errors

    def wait_recv(self, rids: set[str], timeout_s: float = 15.0) -> set[int]:
        """Poll until every request in ``rids`` finished; return the load errors seen."""
        return wait_received(self.poll, rids, timeout_s, interval_s=0.002)

    def verify(self, rid: str, seed: int, computed: int = 0) -> int:
        """Compare every byte D holds for the request's tokens from ``computed`` on; return bytes checked."""
        m = self.model
        main_ids, idx_ids = self.alloc.held[rid]
        first = computed // m.block_size * m.block_size
        positions = torch.arange(first, self.prompts[rid])
        blk, off = positions // m.block_size, positions % m.block_size
        checked = 0
        for i in range(m.layers):
            name = m.main_name(i)
            tensors = [(t, part, main_ids, "pool") for part, t in enumerate(self.pool[name])]
            for rank, idx in enumerate(self.indexers):
                tensors += [(t, 2 + part, idx_ids, f"d{rank} indexer") for part, t in enumerate(idx[name])]
            for t, part, ids, where in tensors:
                got = t[torch.tensor(ids, dtype=torch.long)[blk], off]
                if not torch.equal(got, sfa_pattern(seed, i, part, positions, t.shape[2])):
                    raise AssertionError(f"{rid}: layer {i} part {part} ({where}) differs from P's bytes")
                checked += got.numel() * got.element_size()
        return checked

    def finish(self, rid: str) -> None:
        """The request finished decoding: free its blocks."""
        self.scheduler.request_finished(SfaRequest(rid, rid, self.prompts.pop(rid, 0)))
        self.alloc.release(rid)

    def abort(self, rid: str) -> None:
        """The client went away while D waited for P: vLLM finishes it and tells the workers at the next step."""
        self.finish(rid)
        self._aborted.add(rid)

    def shutdown(self) -> None:
        """Stop every rank's read thread."""
        for w in self.workers:
            w.shutdown()
