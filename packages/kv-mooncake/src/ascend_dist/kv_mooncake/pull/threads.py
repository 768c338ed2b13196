"""D's receiving side: per-peer thread pools pulling each request's blocks from the P ranks it needs.

Runs in: D worker processes. `Receiver.submit` plans one task per P rank (and PP stage) and hands
them to the lane of that P instance (`ascend_dist.kv_mooncake.pull.lanes`: its own threads, so a
hung P delays only its own requests, and a breaker, so after a P stops answering its later
requests fail at once until it answers again). A task fetches (and caches) the P worker's metadata after a
compatibility handshake (`ascend_dist.kv_mooncake.pull.peers`), builds the descriptors of every KV group
(attention and state, `ascend_dist.kv_mooncake.pull.task_batch`), asks P to confirm (and renew)
its lease, reads the blocks, asks again (a read that outlasted the lease, whose blocks P may have
reused meanwhile, fails), and always sends DONE to that P rank, even on failure, so P frees its
blocks (after the request is reported, so DONE's round trip is not on D's critical path). A
failed task records the logical block ids it was to fill, in every KV group, *before* its request
is reported finished. A request still pulling after ``pull_timeout_s`` is reported
failed (its late results are ignored) and P is told at once (a DONE per task not yet confirmed,
sent from the lane's DONE thread), so P frees its blocks without waiting out the lease; its tasks
still queued then skip the read and only count down. Each DONE names its task (`done_sender`), so
a copy P receives twice (a timed-out request's and the task's own, or an RPC retry) counts once. A
request id pulled again while still tracked fails alone (both pulls' blocks reported).

Capabilities: with a deployment secret a task first checks that P signed the params exactly as
they are (`core.capability`; a client may have widened ``remote_block_ids``). One that does not
verify fails the task before P is contacted (load errors, vLLM recomputes the request) and sends no
DONE (P would not count it: the params were never P's). Every ``Renew`` and DONE presents P's
`Grant`.

Quarantine: a failed or timed-out read may still write into D's blocks later
(Mooncake #4247), so its request's blocks are reported as load errors at once but the request
reaches ``finished_recving`` (and vLLM may reuse the blocks) only when none of its reads runs and
``quarantine_s`` has passed since the last failed read; a read that never returns is given up one
more ``pull_timeout_s`` after the deadline (logged). Each request's state (pulling, quarantined,
done, reported failed) is one record of `ascend_dist.kv_mooncake.pull.d_requests.DRequests`.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ascend_dist.common.errors import DeadlineExceeded, LeaseExpired, TransferError, TransferTimeout
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.wire import Handshake
from ascend_dist.kv_mooncake.core.capability import PULL_PURPOSE, CapabilityRefused, check_capability, wall_ms
from ascend_dist.kv_mooncake.core.engine import Reader
from ascend_dist.kv_mooncake.core.mappings import context_parallel_parameters_check
from ascend_dist.kv_mooncake.core.messages import AgentMetadata
from ascend_dist.kv_mooncake.core.ranks import PullMode, pull_mode, select_sources
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.cp_plan import cp_layouts, cp_sources, plan_cp_pull
from ascend_dist.kv_mooncake.pull.d_requests import DRequest, DRequests, DState, PullTask
from ascend_dist.kv_mooncake.pull.lanes import Lane, Lanes, PeerKey
from ascend_dist.kv_mooncake.pull.peers import PeerClient
from ascend_dist.kv_mooncake.pull.sources import pull_source_ranks, state_source_ranks
from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta, pull_capability, pull_grant, rank_host
from ascend_dist.kv_mooncake.pull.task_batch import LocalCache, check_peer_rank, group_pairs, task_batch

__all__ = ["LocalCache", "Receiver", "ShardKind", "done_sender"]


class ShardKind(enum.IntEnum):
    """A pull task's ``shard`` when it is not a CP shard index (those are >= 0)."""

    WHOLE = -1
    """No context parallelism: the task reads every group D wants from one P rank (and PP stage)."""
    STATE_ONLY = -2
    """Context parallelism: the task reads only the state groups (replicated: from P's PCP rank 0)."""


logger = logging.getLogger(__name__)


def done_sender(pcp_rank: int, shard: int) -> str:
    """The DONE ``sender`` of one D task beside its ``d_rank``: P counts each sender once."""
    return f"pcp{pcp_rank}/{shard}"


class NotHeld(LeaseExpired):
    """P answered that it no longer holds the request's blocks (P is alive: not a breaker trip)."""


class PeerDown(TransferError):
    """The P instance's lane is open (it stopped answering): the task fails without asking it."""


def _peer_stopped_answering(exc: BaseException) -> bool:
    """Whether a task's failure means P itself did not answer (what trips its lane's breaker)."""
    if isinstance(exc, DeadlineExceeded):
        return True
    return isinstance(exc, TransferError) and not isinstance(exc, NotHeld | PeerDown | TransferTimeout)


class Reformat(Protocol):
    """``reformat(layer_name, local_block_ids, pulls, sub_tokens=0)``: stacked pulls -> token-major heads."""

    def __call__(self, layer: str, block_ids: Sequence[int], pulls: int, sub_tokens: int = 0) -> None:
        """Reformat the listed blocks (sub-blocks of ``sub_tokens`` tokens when non-zero)."""
        ...


class Receiver:
    """D's thread pool of pulls, completion tracking and load-error reporting."""

    def __init__(
        self,
        config: PullConfig,
        tp_rank: int,
        cache: LocalCache,
        engine: Reader,
        *,
        handshake: Handshake,
        reformat: Reformat,
        clock: Callable[[], float] = time.monotonic,
        pcp_rank: int = 0,
        use_mla: bool = False,
        on_failure: Callable[[BaseException], None] = lambda exc: None,
        secret: DeploymentSecret | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Start the pool (threads are created on demand); ``on_failure`` sees each failed task's error (stats).

        ``secret``: the deployment secret; with it every pull's params must carry P's capability
        (checked before any contact with P) and D presents it in each ``Renew`` and ``Done``.
        """
        self._secret = secret
        self._wall_clock = wall_clock
        self._config = config
        self._pcp_rank = pcp_rank
        self._use_mla = use_mla
        if config.uses_cp:  # refuse a bad CP layout at registration, not per request
            p_info, d_info = cp_layouts(config, use_mla)
            context_parallel_parameters_check(p_info, d_info, cache.heads)
            cp_sources(tp_rank, p_info, d_info, cache.heads)
        self._tp_rank = tp_rank
        self._cache = cache
        self._engine = engine
        self._reformat = reformat
        self._clock = clock
        self._on_failure = on_failure
        self._peers = PeerClient(config, handshake, tp_rank)
        self._lanes = Lanes(config.recv_workers, config.peer_retry_s, clock=clock)
        self._lock = threading.Lock()  # guards the table and the load errors
        self._requests = DRequests(pull_timeout_s=config.pull_timeout_s)
        self._errors: set[int] = set()

    @property
    def cache(self) -> LocalCache:
        """D's cache as the planner sees it (the benchmark plans the same descriptors with it)."""
        return self._cache

    @property
    def in_flight(self) -> int:
        """Requests still pulling."""
        with self._lock:
            return self._requests.count(DState.PULLING)

    @property
    def quarantined(self) -> int:
        """Failed requests whose blocks are held because a late write could still land."""
        with self._lock:
            return self._requests.count(DState.QUARANTINED)

    @property
    def cached_peers(self) -> int:
        """P workers whose metadata is cached."""
        return len(self._peers)

    def peer_metadata(self, engine_id: str, host: str, port: int) -> AgentMetadata | None:
        """The cached metadata of a P worker, if fetched (the benchmark rebuilds descriptors from it)."""
        return self._peers.cached(engine_id, host, port)

    def submit(self, meta: ReqMeta) -> None:
        """Plan a request's pulls and queue them (an empty receive only sends DONEs).

        A request id still tracked (pulled again while live) fails that request alone: vLLM pulls
        an id once, so both pulls' blocks are reported and the worker goes on.
        """
        with self._lock:
            existing = self._requests.live(meta.request_id)
            if existing is not None:
                self._collide(existing, meta)
                return
            if meta.do_virtual:
                self._requests.finish_now(DRequest(meta, deadline=self._clock()))
                return
        record = self._plan_cp(meta) if self._config.uses_cp else self._plan(meta)
        self._launch(record)

    def _collide(self, existing: DRequest, meta: ReqMeta) -> None:
        """Called under the lock: ``meta`` repeats the live ``existing``'s id; both fail."""
        logger.error(
            "request %s: pulled again while its first pull is %s; the request fails (its blocks reported)",
            meta.request_id,
            existing.state.name,
        )
        if self._requests.fail(existing):
            for ids in existing.meta.local_block_ids:
                self._errors.update(ids)
        for ids in meta.local_block_ids:
            self._errors.update(ids)

    @staticmethod
    def _key(meta: ReqMeta) -> PeerKey:
        return (meta.remote_engine_id, meta.remote_host, meta.remote_port)

    def _launch(self, record: DRequest) -> None:
        """Track ``record`` and queue its tasks on its P's lane (or fail it at once if that P is down)."""
        lane = self._lanes.get(self._key(record.meta))
        with self._lock:
            self._requests.start(record)
            if record.tasks and lane.admit(record):
                admitted = True
            else:
                admitted = False
                if record.tasks:
                    logger.error(
                        "request %s: P %s:%d is not answering; failed at once",
                        record.request_id,
                        record.meta.remote_host,
                        record.meta.remote_port,
                    )
                    self._requests.fail(record)
                    for ids in record.meta.local_block_ids:
                        self._errors.update(ids)
                record.pending = 0
                self._requests.end(record, self._clock())
        if admitted:
            for task in record.tasks:
                self._lanes.run(lane, lambda t=task: self._run_task(record, t, lane))

    def _plan(self, meta: ReqMeta) -> DRequest:
        """Plan without context parallelism: one task per P rank (and PP stage) read."""
        p_tp, p_pp = meta.remote_ptp_size, self._config.prefill.pp_size
        slices = select_sources(
            self._tp_rank, p_tp, self._config.decode.tp_size, self._cache.heads, meta.remote_request_id
        )
        ranks = pull_source_ranks(
            self._tp_rank,
            p_tp,
            self._config.decode.tp_size,
            self._cache.heads,
            meta.remote_request_id,
            attention=bool(self._cache.attention_groups),
            state=self._cache.has_state,
        )
        tasks = [PullTask(stage * p_tp + p, ShardKind.WHOLE) for stage in range(p_pp) for p in ranks]
        now = self._clock()
        return DRequest(meta, now + self._config.pull_timeout_s, pending=len(tasks), slices=slices, tasks=tasks)

    def _plan_cp(self, meta: ReqMeta) -> DRequest:
        """Plan with context parallelism: one task per (P CP rank, P rank) of each shard."""
        p_info, d_info = cp_layouts(self._config, self._use_mla)
        bs = self._cache.block_size
        external = max(0, meta.prompt_len - meta.num_computed_tokens) if any(meta.local_block_ids) else 0
        # Every group shares the prompt and block size, so its shards have the same CP ranks and P
        # ranks in the same order; only the block ids differ.
        group_shards = [
            []  # a state group is not interleaved over CP ranks: its own tasks read it (below)
            if g in self._cache.state_groups
            else plan_cp_pull(
                p=p_info,
                d=d_info,
                heads=self._cache.heads,
                d_tp_rank=self._tp_rank,
                d_pcp_rank=self._pcp_rank,
                remote_block_ids=remote,
                local_block_ids=local,
                prompt_len=meta.prompt_len,
                num_external_tokens=external,
                p_block_size=meta.remote_block_size or bs,
                d_block_size=bs,
            )
            for g, (local, remote) in enumerate(zip(meta.local_block_ids, meta.remote_block_ids, strict=True))
        ]
        attn = self._cache.attention_groups
        shards = group_shards[attn[0]] if attn else []
        tasks: list[tuple[int, int]] = [(i, w) for i, s in enumerate(shards) for w in s.p_world_ranks]
        if self._cache.has_state:  # the state is replicated over P's CP ranks: read it from P's PCP rank 0
            p_tp, d_tp = self._config.prefill.tp_size, self._config.decode.tp_size
            tasks += [(ShardKind.STATE_ONLY, w) for w in state_source_ranks(self._tp_rank, p_tp, d_tp)]
        now = self._clock()
        slices = list(shards[0].slices) if shards else []
        return DRequest(
            meta,
            now + self._config.pull_timeout_s,
            pending=len(tasks),
            slices=slices,
            shards=shards,
            group_shards=group_shards,
            tasks=[PullTask(world, shard) for shard, world in tasks],
        )

    def _run_task(self, pull: DRequest, task: PullTask, lane: Lane) -> None:
        """One task: ``task.shard`` is a CP shard index (>= 0) or a `ShardKind`.

        A task of a request that timed out (or was replaced) meanwhile skips its read but still
        counts down and makes sure P got a DONE, so neither side holds the request any longer.
        """
        meta = pull.meta
        port = meta.remote_port + task.global_rank
        host = rank_host(meta, port)  # a P instance spanning nodes: this rank's node
        ok = contacted = True
        unsigned = False  # the params' capability did not verify: P was not contacted and gets no DONE
        try:
            with self._lock:
                live = self._requests.pulling(pull.request_id) is pull
            if not live:
                ok = False
            elif not lane.passes(pull):
                raise PeerDown(f"P {meta.remote_host}:{meta.remote_port} is not answering")
            else:
                contacted = self._read_task(pull, task, port)
        except Exception as exc:  # every failure becomes load errors, never a crash
            ok = False
            unsigned = isinstance(exc, CapabilityRefused)
            logger.error("request %s: pull from %s:%d failed: %s", pull.request_id, host, port, exc)
            self._on_failure(exc)
            if not unsigned:  # P did nothing wrong: its metadata stays cached
                self._peers.forget(meta.remote_engine_id, host, port)
            self._fail(pull)
            if _peer_stopped_answering(exc):
                lane.failed(pull)
        else:
            if live and contacted:  # a task with nothing to read proves nothing about P
                lane.answered(pull)
        finally:
            # Report the request first (D's latency), then release P's blocks with DONE. A P that
            # stopped answering gets none: it would cost this lane's thread the RPC retries.
            self._task_done(pull)
            if self._claim_notice(task) and not unsigned and not (lane.is_open and not ok):
                sender = done_sender(self._pcp_rank, task.shard)
                self._peers.send_done(host, port, meta.remote_request_id, ok, sender=sender, grant=pull_grant(meta))

    def _read_task(self, pull: DRequest, task: PullTask, port: int) -> bool:
        """Read what ``task`` covers; False when D has no block of it to fill (P was not asked)."""
        meta, shard = pull.meta, task.shard
        p_rank = task.global_rank % meta.remote_ptp_size
        if shard >= 0:
            wanted = any(gs[shard].local_ids for gs in pull.group_shards if gs)
        elif shard == ShardKind.STATE_ONLY:
            wanted = any(meta.local_block_ids[g] for g in self._cache.state_groups)
        else:
            wanted = any(meta.local_block_ids)
        if wanted:
            self._pull(pull, port, p_rank, shard)
        return wanted

    def _claim_notice(self, task: PullTask) -> bool:
        """Whether the caller is the one to send ``task``'s DONE (each task's DONE goes once)."""
        with self._lock:
            if task.notified:
                return False
            task.notified = True
            return True

    def _check_capability(self, meta: ReqMeta) -> None:
        """Refuse params P did not sign exactly as they are (a client widened or swapped the block ids)."""
        if self._secret is None:
            return
        check_capability(
            self._secret,
            PULL_PURPOSE,
            pull_capability(meta),
            meta.capability,
            field="kv_transfer_params.remote_capability",
            now_ms=wall_ms(self._wall_clock),
        )

    def _pull(self, pull: DRequest, port: int, p_rank: int, shard: int) -> None:
        meta = pull.meta
        self._check_capability(meta)  # before P is contacted or any byte is read
        grant = pull_grant(meta)
        host = rank_host(meta, port)  # a P instance spanning nodes: this rank's node
        agent = self._peers.metadata(meta.remote_engine_id, host, port)
        # A WHOLE task's global rank spans P's PP stages; CP shard and state-only tasks read stage 0.
        stage = (port - meta.remote_port) // meta.remote_ptp_size if shard == ShardKind.WHOLE else 0
        check_peer_rank(agent, port=port, pp_rank=stage, tp_rank=p_rank)
        # Before reading, P must confirm it still holds this request's blocks: params replayed after
        # D consumed them, or aimed at a request P already freed, would read reused blocks.
        if not self._peers.renew(host, port, meta.remote_request_id, grant):
            raise NotHeld(f"P {host}:{port} holds no blocks for {meta.remote_request_id!r}")
        batch = task_batch(
            self._cache,
            agent,
            meta,
            p_rank=p_rank,
            d_rank=self._tp_rank,
            d_tp=self._config.decode.tp_size,
            slices=pull.slices,
            shards=None if shard < 0 else [gs[shard] if gs else None for gs in pull.group_shards],  # < 0: a kind
            state_only=shard == ShardKind.STATE_ONLY,
        )
        try:
            self._engine.read(agent.te_session, batch.descriptors, timeout_s=max(0.1, pull.deadline - self._clock()))
        except BaseException:
            with self._lock:  # the engine may still write into these blocks: quarantine them
                self._requests.hold(pull, self._clock() + self._config.quarantine_s)
            raise
        # The read may have outlasted P's lease: if P let the blocks go meanwhile they may hold
        # another request's bytes by now, so the read counts only if P still holds them after it.
        # (P's entry for an id never comes back once freed, so "held" now means held throughout.)
        if not self._peers.renew(host, port, meta.remote_request_id, grant):
            raise NotHeld(f"P {host}:{port} released {meta.remote_request_id!r} during the read")
        with self._lock:
            pull.pulled_layers.update(batch.layers)

    def _fail(self, pull: DRequest) -> None:
        with self._lock:
            if self._requests.fail(pull):  # reported once (a timed-out request's late task fails again)
                for ids in pull.meta.local_block_ids:
                    self._errors.update(ids)

    def _task_done(self, pull: DRequest) -> None:
        with self._lock:
            pull.pending -= 1
            if pull.pending > 0 or self._requests.pulling(pull.request_id) is not pull:
                return  # a timed-out request waits in quarantine for pending == 0
            wanted = {n for g, names in enumerate(self._cache.groups) if pull.meta.local_block_ids[g] for n in names}
        if not pull.failed and wanted - pull.pulled_layers:
            logger.error(
                "request %s: layers %s not served by any P stage",
                pull.meta.request_id,
                sorted(wanted - pull.pulled_layers)[:4],
            )
            self._fail(pull)
        if not pull.failed:
            try:
                self._reformat_all(pull)
            except Exception as exc:
                logger.error("request %s: reformat failed: %s", pull.meta.request_id, exc)
                self._fail(pull)
        with self._lock:
            self._requests.end(pull, self._clock())

    def _reformat_all(self, pull: DRequest) -> None:
        attn = [g for g in self._cache.attention_groups if self._cache.groups[g]]
        if not attn or not pull.slices:
            return
        first = self._cache.layers[self._cache.groups[attn[0]][0]][0]
        if pull_mode(pull.slices, pull.slices[0].n_heads, first.heads) is not PullMode.STACKED:
            return
        p_block = pull.meta.remote_block_size or self._cache.block_size
        for g in attn:
            sub = 0
            if pull.group_shards and pull.group_shards[g]:
                ids = [b for s in pull.group_shards[g] for b in s.local_ids]
                sub = p_block if p_block < self._cache.block_size else 0  # sub-block ids
            else:
                ids, _ = group_pairs(self._cache, pull.meta, g)
            for name in self._cache.groups[g]:
                if ids and sub:
                    self._reformat(name, ids, len(pull.slices), sub)
                elif ids:
                    self._reformat(name, ids, len(pull.slices))

    def take_finished(self) -> set[str]:
        """Requests whose pulls ended (ok or failed); those past their deadline are failed now.

        P is told at once about a timed-out request (a DONE per task that has not sent one, from
        the lane's DONE thread) so it frees the blocks now rather than when the lease ends.
        """
        now = self._clock()
        notices: list[tuple[DRequest, PullTask]] = []
        with self._lock:
            expired = self._requests.expire(now)
            for pull in expired:  # its reads may still be running: quarantined
                logger.error(
                    "request %s: pulls not done within %.1f s; reported failed",
                    pull.request_id,
                    self._config.pull_timeout_s,
                )
                self._on_failure(DeadlineExceeded(f"request {pull.request_id}: pull_timeout_s passed"))
                for ids in pull.meta.local_block_ids:
                    self._errors.update(ids)
                for task in pull.tasks:
                    if not task.notified:
                        task.notified = True
                        notices.append((pull, task))
            finished = self._requests.take_finished(now)
        for pull in expired:
            self._lanes.get(self._key(pull.meta)).expired(pull)  # a probe that never ended: P did not answer
        for pull, task in notices:
            self._lanes.run(self._lanes.get(self._key(pull.meta)), lambda p=pull, t=task: self._abort(p, t), note=True)
        return finished

    def _abort(self, pull: DRequest, task: PullTask) -> None:
        """DONE (not ok) for a task of a timed-out request: P frees its blocks now."""
        meta = pull.meta
        port = meta.remote_port + task.global_rank
        sender = done_sender(self._pcp_rank, task.shard)
        host = rank_host(meta, port)
        self._peers.send_done(host, port, meta.remote_request_id, False, sender=sender, grant=pull_grant(meta))

    def take_load_errors(self) -> set[int]:
        """Logical block ids (all groups) whose load failed since the last call."""
        with self._lock:
            out, self._errors = self._errors, set()
            return out

    def take_failed(self, finished: set[str]) -> set[str]:
        """Which of ``finished`` (just taken by `take_finished`) failed; vLLM's per-request failure report."""
        with self._lock:
            return self._requests.take_failed(finished)

    def close(self) -> None:
        """Wait for running pulls (each bounded by the engine's timeout), then close sockets."""
        self._lanes.close()
        self._peers.close()
