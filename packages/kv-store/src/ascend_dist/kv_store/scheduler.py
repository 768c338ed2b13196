"""KVPoolScheduler: prefix lookup, load specs, request trackers and per-step metadata.

Runs in: the scheduler process. Order of calls, as vLLM makes them:
``get_num_new_matched_tokens`` when a request is considered (asks the rank-0 worker over the lookup
RPC), ``update_state_after_alloc`` once its blocks are allocated, ``build_meta`` once per step,
``request_finished`` when a request ends (True = hold its blocks until the workers' saves finished),
``mark_sent`` with the ids the workers reported in ``finished_sending``, ``mark_load_failed`` with
those reported in ``failed_recving`` (their next lookup is skipped: vLLM recomputes them).

Differences from upstream: the delayed-free set shrinks (ids are sent to the workers once
and forgotten); a running request is re-examined every step, so the chunk a step completes
without allocating a block is saved; hashes are our own deterministic prefix hashes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ascend_dist.kv_store.config import PoolConfig
from ascend_dist.kv_store.plan import (
    LoadSpec,
    MambaGroups,
    PoolStepMeta,
    ReqMeta,
    RequestTracker,
    build_req_meta,
    matched_tokens,
)
from ascend_dist.kv_store.sizes import DerivedSizes, floor_to
from ascend_dist.kv_store.token_db import hash_root, prefix_hashes, tail_hash

__all__ = ["KVPoolScheduler", "LookupFn", "NewRequest", "RunningRequest", "StepInput"]

logger = logging.getLogger(__name__)

LookupFn = Callable[[int, tuple[bytes, ...], tuple[int, ...], int, bytes], int]


@dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time (or resumed after preemption) this step."""

    req_id: str
    prompt_token_ids: Sequence[int]
    block_ids: Sequence[Sequence[int]]
    num_computed_tokens: int
    num_scheduled_tokens: int
    all_token_ids: Sequence[int] | None = None
    salt: str = ""


@dataclass(frozen=True)
class RunningRequest:
    """A request that was already running: this step's new tokens and blocks."""

    req_id: str
    new_token_ids: Sequence[int]
    new_block_ids: Sequence[Sequence[int]] | None
    num_computed_tokens: int


@dataclass(frozen=True)
class StepInput:
    """The parts of vLLM's ``SchedulerOutput`` the pool reads."""

    new: Sequence[NewRequest] = ()
    running: Sequence[RunningRequest] = ()
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()


@dataclass
class _Pending:
    prompt: list[int]
    root: bytes
    hashes: list[bytes]
    load: LoadSpec | None = None
    block_ids: list[list[int]] = field(default_factory=list)
    tail: bytes | None = None


class KVPoolScheduler:
    """The scheduler side of the pool."""

    def __init__(
        self,
        config: PoolConfig,
        sizes: DerivedSizes,
        namespace: tuple[str | int, ...],
        lookup: LookupFn,
        *,
        mamba: MambaGroups | None = None,
        retention_interval: int | None = None,
    ) -> None:
        """Create the scheduler side.

        Args:
            config: Pool settings.
            sizes: Derived block sizes (same as the workers').
            namespace: What makes two instances' hashes comparable (model name, layout); part of
                every hash chain's root.
            lookup: Asks the pool (normally `LookupClient.lookup`); must not raise.
            mamba: Mamba ``align`` groups, whose stale state blocks are nulled in the trackers.
            retention_interval: vLLM's ``prefix_cache_retention_interval``: prompts shorter than two
                intervals are not looked up (their sparse checkpoints cannot serve a hit worth a load).
        """
        self._cfg = config
        self._sizes = sizes
        self._g = sizes.granularity
        self._hb = sizes.hash_block_size
        self._namespace = namespace
        self._lookup = lookup
        self._mamba = mamba
        self._num_groups = len(sizes.grouped_block_sizes)
        self._pending: dict[str, _Pending] = {}
        self._trackers: dict[str, RequestTracker] = {}
        self._roots: dict[str, bytes] = {}
        self._saved_any: set[str] = set()
        self._async_loads: set[str] = set()
        self._new_delayed: set[str] = set()
        self._held: set[str] = set()
        self._load_failed: set[str] = set()
        self._root_by_salt: dict[str, bytes] = {}
        self._short_prompt = 2 * retention_interval if retention_interval and not config.use_layerwise else 0
        # Shared layer buffers (memcache GVA path): reused layers lose a request's KV to the other
        # layers of their buffer every step, so every step reloads the prefix from the pool.
        self._reload = config.use_layerwise and config.layerwise_num_shared_buffers > 0
        self.lookups = 0

    @property
    def held_req_ids(self) -> frozenset[str]:
        """Finished requests whose blocks are held until their saves complete."""
        return frozenset(self._held)

    def hashes_for(self, prompt: Sequence[int], salt: str = "") -> tuple[bytes, list[bytes]]:
        """The chain root and prefix hashes of ``prompt``."""
        root = self._root_by_salt.get(salt)
        if root is None:  # the root hashes the whole namespace (~20 us): once per salt
            root = self._root_by_salt.setdefault(salt, hash_root(*self._namespace, self._hb, salt))
        return root, prefix_hashes(prompt, self._hb, root)

    def tail_for(self, prompt: Sequence[int], root: bytes, hashes: Sequence[bytes]) -> bytes | None:
        """Hash of the prompt's partial last chunk when partial chunks are pooled (one KV group only)."""
        if self._cfg.discard_partial_chunks or self._num_groups != 1:
            return None
        return tail_hash(prompt, hashes, self._g, self._hb, root)

    def get_num_new_matched_tokens(
        self, req_id: str, prompt: Sequence[int], num_tokens: int, num_computed: int, *, salt: str = ""
    ) -> tuple[int, bool]:
        """Tokens beyond ``num_computed`` vLLM can load from the pool, and whether asynchronously."""
        if not self._cfg.can_load:
            return 0, False
        if req_id in self._load_failed:  # its pool load failed: recompute, do not retry the pool (no loop)
            self._load_failed.discard(req_id)
            self._pending.pop(req_id, None)
            self._async_loads.discard(req_id)
            return 0, False
        if len(prompt) < self._short_prompt:  # sparse retention: a short prompt is never looked up
            return 0, False
        # A Mamba state is the whole prefix: loading the state after the full prompt and recomputing
        # its last token (vLLM always computes one) would apply that token twice. So with Mamba groups
        # the hit stops before the last token, as vLLM's own Mamba prefix cache does.
        token_len = floor_to(len(prompt) - 1 if self._mamba else len(prompt), self._g)
        partial = not self._cfg.discard_partial_chunks and self._num_groups == 1 and token_len < len(prompt)
        if partial:
            token_len = len(prompt)
        if (token_len < self._g and not partial) or num_computed >= token_len:
            return 0, False
        root, hashes = self.hashes_for(prompt, salt)
        tail = self.tail_for(prompt, root, hashes)
        self._pending[req_id] = _Pending(list(prompt), root, hashes, tail=tail)
        self.lookups += 1
        hit = self._lookup(token_len, tuple(hashes), tuple(range(self._num_groups)), num_computed, tail or b"")
        need, is_async, spec = matched_tokens(
            min(hit, token_len), num_computed, num_tokens, load_async=self._cfg.async_loads
        )
        if spec is None and self._reload and num_computed > 0:
            spec = LoadSpec(num_computed, num_computed, num_computed, True)  # vLLM's HBM hit, lost by reused layers
        self._pending[req_id].load = spec
        return need, is_async

    def update_state_after_alloc(
        self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Arm the load of ``req_id`` once vLLM allocated its blocks."""
        pending = self._pending.get(req_id)
        if pending is None or pending.load is None:
            return
        if num_external_tokens == 0 and not (self._reload and pending.load.can_load):
            pending.load = None
            return
        spec = pending.load
        pending.load = LoadSpec(spec.vllm_cached_tokens, spec.pool_cached_tokens, spec.store_skip_tokens, True)
        pending.block_ids = [list(ids) for ids in block_ids]
        if self._cfg.async_loads:
            self._async_loads.add(req_id)

    def _forget(self, req_id: str) -> None:
        for table in (self._pending, self._trackers, self._roots):
            table.pop(req_id, None)
        self._async_loads.discard(req_id)

    def mark_load_failed(self, req_ids: Sequence[str] | set[str] | frozenset[str]) -> None:
        """The workers reported these async loads failed (``failed_recving``); vLLM recomputes them.

        Their stale load state is dropped and their next lookup answers 0 hits, so a load that keeps
        failing (a key present but unreadable) cannot loop; the recomputed chunks are saved again.
        """
        for req_id in req_ids:
            self._pending.pop(req_id, None)
            self._async_loads.discard(req_id)
            self._load_failed.add(req_id)

    def mark_blocks_invalid(self, block_ids: Iterable[int]) -> None:
        """Blocks whose loads vLLM reports failed (``invalid_block_ids``, one KV group).

        vLLM recomputes such a request from its first bad block; its saves must resume there too,
        or the recomputed chunks (missing from the pool, which is why the load failed) would never
        be saved again because the request's load state counts them as pooled.
        """
        bad = set(block_ids)
        if not bad:
            return
        span = self._sizes.grouped_block_sizes[0]
        for pending in self._pending.values():
            first = _first_index(pending.block_ids, bad)
            if first is not None and pending.load is not None:
                load = pending.load
                skip = min(load.store_skip_tokens, floor_to(first * span, self._g))
                pending.load = LoadSpec(load.vllm_cached_tokens, load.pool_cached_tokens, skip, load.can_load)
        for tracker in self._trackers.values():
            first = _first_index(tracker.block_ids, bad)
            if first is not None:
                tracker.num_saved_tokens = min(tracker.num_saved_tokens, floor_to(first * span, self._g))

    def _new_tracker(self, req: NewRequest, pending: _Pending | None) -> tuple[RequestTracker, LoadSpec | None]:
        tokens = list(req.all_token_ids if req.all_token_ids is not None else req.prompt_token_ids)
        token_len = req.num_computed_tokens + req.num_scheduled_tokens
        if pending is None:
            root, hashes = self.hashes_for(req.prompt_token_ids, req.salt)
            load, tail = None, self.tail_for(req.prompt_token_ids, root, hashes)
        else:
            root, hashes, load, tail = pending.root, pending.hashes, pending.load, pending.tail
        tracker = RequestTracker(
            req.req_id, tokens[:token_len], len(req.prompt_token_ids), [list(ids) for ids in req.block_ids], hashes
        )
        tracker.tail = tail
        if load is not None:
            tracker.num_saved_tokens = floor_to(load.store_skip_tokens, self._g)
        self._roots[req.req_id] = root
        return tracker, load

    def _meta(self, tracker: RequestTracker, load: LoadSpec | None, *, skip_save: bool) -> ReqMeta | None:
        last = floor_to(tracker.num_prompt_tokens, self._g)
        meta = build_req_meta(
            tracker,
            self._g,
            hash_block_size=self._hb,
            discard_partial=self._cfg.discard_partial_chunks,
            load_spec=load,
            skip_save=skip_save,
            is_last_chunk=tracker.token_len >= last,
            with_token_ids=self._cfg.kv_events,
        )
        if meta is not None and meta.can_save:
            self._saved_any.add(tracker.req_id)
        return meta

    def build_meta(self, step: StepInput) -> PoolStepMeta:
        """Build this step's worker metadata."""
        for req_id in step.finished_req_ids | step.preempted_req_ids:
            self._forget(req_id)
        skip_save = not self._cfg.can_save
        metas: list[ReqMeta] = []
        scheduled: set[str] = set()
        for req in step.new:
            scheduled.add(req.req_id)
            pending = self._pending.pop(req.req_id, None)
            self._async_loads.discard(req.req_id)
            tracker, load = self._new_tracker(req, pending)
            self._trackers[req.req_id] = tracker
            meta = self._meta(tracker, load, skip_save=skip_save)
            if meta is not None:
                metas.append(meta)
        for run in step.running:
            scheduled.add(run.req_id)
            tracker = self._trackers.get(run.req_id)
            if tracker is None or skip_save:
                continue
            tracker.update(
                run.new_token_ids, run.new_block_ids, mamba=self._mamba, num_computed=run.num_computed_tokens
            )
            decoding = run.num_computed_tokens >= tracker.num_prompt_tokens
            if decoding and not (self._cfg.save_decode_cache or self._reload):
                continue
            if decoding:
                tracker.hashes = prefix_hashes(tracker.token_ids, self._hb, self._roots[run.req_id])
            cur = run.num_computed_tokens
            reload = LoadSpec(cur, cur, cur, True) if self._reload and cur > 0 else None
            meta = self._meta(tracker, reload, skip_save=False)
            if meta is not None:
                metas.append(meta)
        metas.extend(self._async_metas(scheduled))
        delayed, self._new_delayed = frozenset(self._new_delayed), set()
        return PoolStepMeta(tuple(metas), frozenset(step.preempted_req_ids), delayed)

    def _async_metas(self, scheduled: set[str]) -> list[ReqMeta]:
        out: list[ReqMeta] = []
        for req_id in sorted(self._async_loads - scheduled):
            pending = self._pending.get(req_id)
            if pending is None or pending.load is None:
                continue
            load = pending.load
            pending.load = LoadSpec(load.vllm_cached_tokens, load.pool_cached_tokens, load.store_skip_tokens, False)
            token_len = load.load_token_len(self._g, floor_to(len(pending.prompt), self._g))
            tracker = RequestTracker(
                req_id, pending.prompt[:token_len], len(pending.prompt), pending.block_ids, pending.hashes
            )
            tracker.tail = pending.tail
            meta = self._meta(tracker, load, skip_save=True)
            if meta is not None:
                out.append(meta)
        self._async_loads -= {m.req_id for m in out}
        return out

    def request_finished(self, req_id: str) -> bool:
        """Whether vLLM must hold the request's blocks until the workers report its saves done."""
        self._pending.pop(req_id, None)
        self._load_failed.discard(req_id)
        if not self._cfg.can_save or req_id not in self._saved_any:
            return False
        self._saved_any.discard(req_id)
        self._new_delayed.add(req_id)
        self._held.add(req_id)
        return True

    def mark_sent(self, req_ids: Sequence[str] | set[str] | frozenset[str]) -> None:
        """The workers reported these held requests' saves complete."""
        self._held -= set(req_ids)


def _first_index(block_ids: Sequence[Sequence[int]], bad: set[int]) -> int | None:
    """Position of the first of ``bad`` in group 0's block ids (None if none is there)."""
    ids = block_ids[0] if block_ids else ()
    return next((i for i, block in enumerate(ids) if block in bad), None)
