"""KVPoolScheduler: prefix lookup, load specs, request trackers and per-step metadata.

Runs in: the scheduler process. Order of calls, as vLLM makes them:
``get_num_new_matched_tokens`` when a request is considered (asks the rank-0 worker over the lookup
RPC), ``update_state_after_alloc`` once its blocks are allocated, ``build_meta`` once per step,
``request_finished`` when a request ends (True = hold its blocks until the workers' saves finished),
``mark_sent`` with the ids the workers reported in ``finished_sending``, ``mark_load_failed`` with
those reported in ``failed_recving`` (their next lookup is skipped: vLLM recomputes them).

Per-request state lives in one table (`ascend_dist.kv_store.scheduler.requests`): a record per
request, one state each (WAITING -> LOADING -> RUNNING -> FINISHED_SAVING -> DONE, plus PREEMPTED
and LOAD_FAILED), every move checked.

Differences from upstream: the delayed-free set shrinks (ids are sent to the workers once
and forgotten); a running request is re-examined every step, so the chunk a step completes
without allocating a block is saved; hashes are our own deterministic prefix hashes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ascend_dist.kv_store.config.config import PoolConfig
from ascend_dist.kv_store.config.sizes import DerivedSizes, floor_to
from ascend_dist.kv_store.keys.token_db import hash_root, prefix_hashes, tail_hash
from ascend_dist.kv_store.scheduler.plan import MambaGroups, RequestTracker, build_req_meta, matched_tokens
from ascend_dist.kv_store.scheduler.requests import LIVE_STATES, Lookup, PoolRequest, PoolRequests, PoolState
from ascend_dist.kv_store.step_metadata import LoadSpec, PoolStepMeta, ReqMeta

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
        self.requests = PoolRequests()  # every request's state (scheduler/requests.py)
        self._new_delayed: set[str] = set()  # outbox: finished ids to hand the workers in the next step
        self._root_by_salt: dict[str, bytes] = {}
        self._short_prompt = 2 * retention_interval if retention_interval and not config.use_layerwise else 0
        # Shared layer buffers (memcache GVA path): reused layers lose a request's KV to the other
        # layers of their buffer every step, so every step reloads the prefix from the pool.
        self._reload = config.use_layerwise and config.layerwise_num_shared_buffers > 0
        self.lookups = 0
        # Group-0 blocks whose load failed and that no step rewrote since. vLLM 0.33's recompute
        # policy keeps them in its prefix cache: a request hitting one (or resumed onto it) would
        # save it under the chunk's valid key. Saves stop before them (`_save_limit`).
        self._unwritten: set[int] = set()

    @property
    def held_req_ids(self) -> frozenset[str]:
        """Finished requests whose blocks are held until their saves complete."""
        return frozenset(r.req_id for r in self.requests.in_state(PoolState.FINISHED_SAVING))

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
        record = self.requests.get(req_id)
        if record is not None and record.skip_next_lookup:  # its load failed: recompute, no pool retry (no loop)
            if record.state is not PoolState.WAITING:
                self.requests.move(record, PoolState.WAITING)
            record.skip_next_lookup, record.lookup, record.async_load = False, None, False
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
        record = self.requests.enter(req_id, PoolState.WAITING)
        record.lookup = pending = Lookup(list(prompt), root, hashes, tail=tail)
        self.lookups += 1
        hit = self._lookup(token_len, tuple(hashes), tuple(range(self._num_groups)), num_computed, tail or b"")
        need, is_async, spec = matched_tokens(
            min(hit, token_len), num_computed, num_tokens, load_async=self._cfg.async_loads
        )
        if spec is None and self._reload and num_computed > 0:
            spec = LoadSpec(num_computed, num_computed, num_computed, True)  # vLLM's HBM hit, lost by reused layers
        pending.load = spec
        return need, is_async

    def update_state_after_alloc(
        self, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Arm the load of ``req_id`` once vLLM allocated its blocks."""
        record = self.requests.get(req_id)
        pending = None if record is None else record.lookup
        if record is None or pending is None or pending.load is None:
            return
        if num_external_tokens == 0 and not (self._reload and pending.load.can_load):
            pending.load = None
            return
        self.requests.move(record, PoolState.LOADING)
        spec = pending.load
        pending.load = LoadSpec(spec.vllm_cached_tokens, spec.pool_cached_tokens, spec.store_skip_tokens, True)
        pending.block_ids = [list(ids) for ids in block_ids]
        if self._cfg.async_loads:
            record.async_load = True

    def mark_load_failed(self, req_ids: Sequence[str] | set[str] | frozenset[str]) -> None:
        """The workers reported these async loads failed (``failed_recving``); vLLM recomputes them.

        Their stale load state is dropped and their next lookup answers 0 hits, so a load that keeps
        failing (a key present but unreadable) cannot loop; the recomputed chunks are saved again.
        """
        for req_id in req_ids:
            record = self.requests.get(req_id)
            if record is not None and record.state is PoolState.FINISHED_SAVING:
                continue  # finished: it is never looked up again
            if record is None or record.state in (PoolState.WAITING, PoolState.LOADING):
                record = self.requests.enter(req_id, PoolState.LOAD_FAILED)
            # Elsewhere (scheduled, preempted) only the next lookup is skipped.
            record.lookup, record.async_load, record.skip_next_lookup = None, False, True

    def mark_blocks_invalid(self, block_ids: Iterable[int]) -> None:
        """Blocks whose loads vLLM reports failed (``invalid_block_ids``, one KV group).

        vLLM recomputes such a request from its first bad block; its saves must resume there too,
        or the recomputed chunks (missing from the pool, which is why the load failed) would never
        be saved again because the request's load state counts them as pooled.
        """
        bad = set(block_ids)
        if not bad:
            return
        if self._num_groups == 1:  # block ids repeat across groups (vLLM reports none for several)
            self._unwritten |= bad
        span = self._sizes.grouped_block_sizes[0]
        for record in self.requests:
            pending, tracker = record.lookup, record.tracker
            first = None if pending is None else _first_index(pending.block_ids, bad)
            if pending is not None and first is not None and pending.load is not None:
                load = pending.load
                skip = min(load.store_skip_tokens, floor_to(first * span, self._g))
                pending.load = LoadSpec(load.vllm_cached_tokens, load.pool_cached_tokens, skip, load.can_load)
            first = None if tracker is None else _first_index(tracker.block_ids, bad)
            if tracker is not None and first is not None:
                tracker.num_saved_tokens = min(tracker.num_saved_tokens, floor_to(first * span, self._g))

    def _forget(self, finished: frozenset[str], preempted: frozenset[str]) -> None:
        """Drop finished and preempted requests' working data; preempted ones move to ``PREEMPTED``.

        A finished request's state is `request_finished`'s to move (vLLM calls it first).
        """
        for req_id in finished | preempted:
            record = self.requests.get(req_id)
            if record is None:
                continue
            if req_id in preempted and record.state in LIVE_STATES - {PoolState.PREEMPTED}:
                self.requests.move(record, PoolState.PREEMPTED)
            record.drop_working_data()

    def _new_tracker(self, req: NewRequest, pending: Lookup | None) -> tuple[RequestTracker, LoadSpec | None, bytes]:
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
        return tracker, load, root

    def _rewritten(self, block_ids: Sequence[Sequence[int]], start: int, end: int) -> None:
        """This step writes tokens ``[start, end)`` into ``block_ids``: blocks it fills to their end hold chunks."""
        if not self._unwritten or not block_ids or end <= start:
            return
        span, ids = self._sizes.grouped_block_sizes[0], block_ids[0]
        for i in range(start // span, min(end // span, len(ids))):
            self._unwritten.discard(ids[i])

    def _save_limit(self, tracker: RequestTracker) -> int | None:
        """First token of the first block still to save that holds no chunk (a failed load not rewritten yet)."""
        if not self._unwritten or not tracker.block_ids:
            return None
        span, ids = self._sizes.grouped_block_sizes[0], tracker.block_ids[0]
        start = tracker.num_saved_tokens // span
        return next((i * span for i in range(start, len(ids)) if ids[i] in self._unwritten), None)

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
            save_limit=self._save_limit(tracker),
        )
        record = self.requests.get(tracker.req_id)
        if meta is not None and meta.can_save and record is not None:
            record.saved_any = True
        return meta

    def build_meta(self, step: StepInput) -> PoolStepMeta:
        """Build this step's worker metadata."""
        self._forget(step.finished_req_ids, step.preempted_req_ids)
        skip_save = not self._cfg.can_save
        metas: list[ReqMeta] = []
        scheduled: set[str] = set()
        for req in step.new:  # what this step's loads and forward write, before any save is planned
            record = self.requests.get(req.req_id)
            load = None if record is None or record.lookup is None else record.lookup.load
            if load is not None and load.can_load:
                self._rewritten(req.block_ids, load.vllm_cached_tokens, load.pool_cached_tokens)
            self._rewritten(req.block_ids, req.num_computed_tokens, req.num_computed_tokens + req.num_scheduled_tokens)
        for req in step.new:
            scheduled.add(req.req_id)
            record = self.requests.enter(req.req_id, PoolState.RUNNING)
            pending, record.lookup, record.async_load = record.lookup, None, False
            tracker, load, root = self._new_tracker(req, pending)
            record.tracker, record.root = tracker, root
            meta = self._meta(tracker, load, skip_save=skip_save)
            if meta is not None:
                metas.append(meta)
        for run in step.running:
            scheduled.add(run.req_id)
            record = self.requests.get(run.req_id)
            tracker = None if record is None else record.tracker
            if record is None or tracker is None or skip_save:
                continue
            tracker.update(
                run.new_token_ids, run.new_block_ids, mamba=self._mamba, num_computed=run.num_computed_tokens
            )
            self._rewritten(
                tracker.block_ids, run.num_computed_tokens, run.num_computed_tokens + len(run.new_token_ids)
            )
            decoding = run.num_computed_tokens >= tracker.num_prompt_tokens
            if decoding and not (self._cfg.save_decode_cache or self._reload):
                continue
            if decoding:
                assert record.root is not None  # set with the tracker
                tracker.hashes = prefix_hashes(tracker.token_ids, self._hb, record.root)
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
        emitted: list[PoolRequest] = []
        for record in sorted(self.requests, key=lambda r: r.req_id):
            req_id, pending = record.req_id, record.lookup
            if not record.async_load or req_id in scheduled or pending is None or pending.load is None:
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
                emitted.append(record)
        for record in emitted:
            record.async_load = False
        return out

    def request_finished(self, req_id: str) -> bool:
        """Whether vLLM must hold the request's blocks until the workers report its saves done."""
        record = self.requests.get(req_id)
        if record is None or record.state is PoolState.FINISHED_SAVING:
            return False  # unknown, or asked twice: the first answer holds
        # LOADING at its end: an async load was handed to the workers (vLLM's WAITING_FOR_REMOTE_KVS).
        # vLLM holds its blocks itself until that load's ``finished_recving``, which frees them and
        # forgets the request: a hold of ours, reported later in ``finished_sending``, would hit
        # vLLM's ``assert req_id in self.requests`` (or, reported first, free the blocks while the
        # load writes them). No save reads these blocks: allocated for the load, never scheduled,
        # and the saves of its blocks before a preemption were settled by that step's fence.
        if not self._cfg.can_save or not record.saved_any or record.state is PoolState.LOADING:
            self.requests.move(record, PoolState.DONE)
            return False
        self.requests.move(record, PoolState.FINISHED_SAVING)
        record.lookup, record.skip_next_lookup, record.saved_any = None, False, False
        self._new_delayed.add(req_id)
        return True

    def mark_sent(self, req_ids: Sequence[str] | set[str] | frozenset[str]) -> None:
        """The workers reported these held requests' saves complete."""
        for req_id in req_ids:
            record = self.requests.get(req_id)
            if record is not None and record.state is PoolState.FINISHED_SAVING:
                self.requests.move(record, PoolState.DONE)


def _first_index(block_ids: Sequence[Sequence[int]], bad: set[int]) -> int | None:
    """Position of the first of ``bad`` in group 0's block ids (None if none is there)."""
    ids = block_ids[0] if block_ids else ()
    return next((i for i, block in enumerate(ids) if block in bad), None)
