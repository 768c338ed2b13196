"""D's receiving side: per-peer lanes reading each step's requests in batches from the P ranks they need.

Runs in: D worker processes. `Receiver.submit_step` plans (`pull.d_plan.PullPlanner`) one task per
P rank (and PP stage) of each request and queues a step's tasks on the lane of their P instance together
(`ascend_dist.kv_mooncake.pull.lanes`: its own queue and readers, so a hung P delays only its own
requests, and a breaker, so after a P stops answering its later requests fail at once until it
answers again). A reader takes up to ``recv_batch_requests`` queued tasks (`Receiver._run_batch`)
and per P rank fetches (and caches) the P worker's metadata after a compatibility handshake
(`ascend_dist.kv_mooncake.pull.peers`), builds each task's descriptors for every KV group
(attention and state, `ascend_dist.kv_mooncake.pull.task_batch`), asks P once whether it still
holds the blocks of every request in the batch (one `Renew` per ``recv_batch_bytes``, renewing
their leases), then reads them one request per engine call, in turn, reporting each as soon as its
own read ends (the first request does not wait for the batch's last byte), and, only when a read
ended past half the lease P promised in that answer, asks again for that request (a read that
outlasted a lease, whose blocks P may have reused meanwhile, fails that request alone). A read
that ended sooner was inside the lease: P's lease began after D asked, and only the pull's own
reader can free the blocks early (each pull names itself with a random token, `DRequest.reader`;
P serves one reader per slot, so params replayed to a second D request are refused and its DONE
frees nothing). P's answer names its process: one other than the cached metadata's (P restarted
on its side-channel port) fails the batch unread (`PeerRestarted`), and the metadata is fetched
again for the next requests. Each request is then reported and
its DONE queued: the lane's DONE thread sends the queued DONEs as one `Dones` list per P rank, even
after a failure, so P frees its blocks off D's critical path. A failed read fails (and
quarantines) its request and fails the batch's requests not read yet (unread: they would read
from the same P), and no others. A failed task records the logical block ids it was
to fill, in every KV group, *before* its request is reported finished. A request still pulling
after ``pull_timeout_s`` is reported failed (its late results are ignored) and P is told at once
(a DONE per task not yet confirmed, queued on the lane's DONE thread), so P frees its blocks
without waiting out the lease; its tasks still queued then skip the read and only count down. Each
DONE names its task (`done_sender`), so a copy P receives twice (a timed-out request's and the
task's own, or an RPC retry) counts once. A request id pulled again while still tracked fails alone
(both pulls' blocks reported).

Capabilities: with a deployment secret a task first checks that P signed the params exactly as
they are (`core.capability`; a client may have widened ``remote_block_ids``). One that does not
verify fails the task before P is contacted (load errors, vLLM recomputes the request) and sends no
DONE (P would not count it: the params were never P's). Every ``Renew`` and DONE presents P's
`Grant`.

Quarantine: a failed or timed-out read may still write into D's blocks later
(Mooncake #4247: its TCP transport's pending receive outlives a failed read, and a read hung on a
dead link lands when the link returns), so its request's blocks are reported as load errors at
once but the request reaches ``finished_recving`` (and vLLM may reuse the blocks) only when none of
its reads runs and ``quarantine_s`` has passed since the last failed read. A read still running
one more ``pull_timeout_s`` past the deadline is ended by cutting D's connections to that P's
transport (`core.tcp_sockets`); the request stays held until the read has returned and
``cut_hold_s`` has passed since the cut (Mooncake still sends pieces it queued for that P once the
link returns). (Only then:
Mooncake keeps the cut connections pooled, so the next reads to that P fail at once on them and
are read again, `Receiver._read`; cutting after every failed read would make each such failure
cut again.) A P whose new session shows up on a transport port of an old one has the old one's
connections cut first (`PeerConnections.adopt`; on the first sight of a port, those its peer
closed). Each request's state (pulling, quarantined, done, reported failed) is one record of
`ascend_dist.kv_mooncake.pull.d_requests.DRequests`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ascend_dist.common.errors import DeadlineExceeded, LeaseExpired, TransferError, TransferTimeout
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.wire import Handshake
from ascend_dist.kv_mooncake.core.capability import PULL_PURPOSE, CapabilityRefused, check_capability, wall_ms
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import Reader
from ascend_dist.kv_mooncake.core.messages import AgentMetadata
from ascend_dist.kv_mooncake.core.ranks import PullMode, pull_mode
from ascend_dist.kv_mooncake.core.session_owners import SESSION_OWNERS, SessionOwners, SessionReused
from ascend_dist.kv_mooncake.core.tcp_sockets import PEER_CONNECTIONS, PeerConnections
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.d_plan import PullPlanner, ShardKind
from ascend_dist.kv_mooncake.pull.d_requests import DRequest, DRequests, DState, PullTask
from ascend_dist.kv_mooncake.pull.lanes import Lane, Lanes, PeerKey
from ascend_dist.kv_mooncake.pull.messages import DoneItem
from ascend_dist.kv_mooncake.pull.peers import LeaseAsk, PeerClient, PeerRestarted
from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta, pull_capability, pull_grant, rank_host
from ascend_dist.kv_mooncake.pull.task_batch import LocalCache, TaskBatch, group_pairs

__all__ = ["LocalCache", "Receiver", "done_sender"]


logger = logging.getLogger(__name__)

FAST_FAILURE_S = 0.5
"""A read that fails within this long, after D cut connections to that P, failed on one of them."""

LEASE_TRUST = 0.5
"""A read that ends within this share of the lease P promised (timed from before D asked) needs no
check after it: the rest is room for two hosts' clocks running at different rates."""


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
    return isinstance(exc, TransferError) and not isinstance(
        exc, NotHeld | PeerRestarted | PeerDown | TransferTimeout | SessionReused
    )


@dataclass(eq=False)
class _Item:
    """One queued task inside a read batch: where it reads, what it read, how it ended."""

    pull: DRequest
    task: PullTask
    port: int
    live: bool = True
    contacted: bool = True
    ok: bool = True
    unsigned: bool = False  # the params' capability did not verify: P was not contacted and gets no DONE
    error: BaseException | None = None
    batch: TaskBatch | None = None

    def fail(self, exc: BaseException) -> None:
        """The task failed with ``exc`` (the first failure is the one reported)."""
        if self.error is None:
            self.error = exc
        self.ok = False
        self.unsigned = self.unsigned or isinstance(exc, CapabilityRefused)


def _by_request(items: list[_Item]) -> Iterator[tuple[int, list[_Item]]]:
    """``items`` cut into runs of one request's tasks, each with the index it starts at."""
    start = 0
    while start < len(items):
        end = start + 1
        while end < len(items) and items[end].pull is items[start].pull:
            end += 1
        yield start, items[start:end]
        start = end


class Reformat(Protocol):
    """``reformat(layer_name, local_block_ids, pulls, sub_tokens=0)``: stacked pulls -> token-major heads."""

    def __call__(self, layer: str, block_ids: Sequence[int], pulls: int, sub_tokens: int = 0) -> None:
        """Reformat the listed blocks (sub-blocks of ``sub_tokens`` tokens when non-zero)."""
        ...


class Receiver:
    """D's batched pulls per P lane, completion tracking and load-error reporting."""

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
        thread_cpus: frozenset[int] | None = None,
        connections: PeerConnections = PEER_CONNECTIONS,
        sessions: SessionOwners | None = SESSION_OWNERS,
    ) -> None:
        """Start the pool (threads are created on demand); ``on_failure`` sees each failed task's error (stats).

        ``secret``: the deployment secret; with it every pull's params must carry P's capability
        (checked before any contact with P) and D presents it in each ``Renew`` and ``Done``.
        ``thread_cpus``: the CPUs the pool's threads run on (`core.affinity.transfer_cpus`; they
        are started from vLLM's bound forward thread); None: where they start.
        ``connections``: this process's connections to P transports (`core.tcp_sockets`): cut to
        end a read D gave up on, and what explains a read failing at once afterwards.
        ``sessions``: which P process each Mooncake session name was first read from in this
        process (`core.session_owners`; None where the engine refreshes a peer's descriptor itself).
        """
        self._secret = secret
        self._wall_clock = wall_clock
        self._config = config
        self._pcp_rank = pcp_rank
        # refuses a bad CP layout here, at registration, not per request
        self._planner = PullPlanner(config, tp_rank, cache, pcp_rank=pcp_rank, use_mla=use_mla)
        self._cache = cache
        self._engine = engine
        self._reformat = reformat
        self._clock = clock
        self._on_failure = on_failure
        self._connections = connections
        self._sessions = sessions
        self._peers = PeerClient(config, handshake, tp_rank)
        self._lanes = Lanes(
            config.recv_workers,
            config.peer_retry_s,
            clock=clock,
            run_batch=self._run_batch,
            max_batch=config.recv_batch_requests,
            thread_cpus=thread_cpus,
        )
        self._lock = threading.Lock()  # guards the table, the load errors and the DONE outbox
        self._outbox: dict[Lane, list[tuple[str, int, DoneItem]]] = {}  # DONEs not sent yet (host, port, item)
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

    def reader_of(self, request_id: str) -> str | None:
        """The token D's pull of ``request_id`` names itself with to P (None when not pulling)."""
        with self._lock:
            pull = self._requests.pulling(request_id)
            return None if pull is None else pull.reader

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
        """Plan a request's pulls and queue them (an empty receive only sends DONEs); see `submit_step`."""
        self.submit_step([meta])

    def submit_step(self, metas: Iterable[ReqMeta]) -> None:
        """Plan one step's requests and queue their pulls, each lane's at once (so one batch reads them).

        A request id still tracked (pulled again while live) fails that request alone: vLLM pulls
        an id once, so both pulls' blocks are reported and the worker goes on.
        """
        queued: dict[Lane, list[tuple[DRequest, PullTask]]] = {}
        try:
            for meta in metas:
                with self._lock:
                    existing = self._requests.live(meta.request_id)
                    if existing is not None:
                        self._collide(existing, meta)
                        continue
                    if meta.do_virtual:
                        self._requests.finish_now(DRequest(meta, deadline=self._clock()))
                        continue
                record = self._planner.plan(meta, self._clock())
                lane = self._launch(record)
                if lane is not None:
                    queued.setdefault(lane, []).extend((record, task) for task in record.tasks)
        finally:
            for lane, tasks in queued.items():
                self._lanes.queue(lane, tasks)

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

    def _launch(self, record: DRequest) -> Lane | None:
        """Track ``record``; the lane to queue its tasks on (None: failed at once, that P is down)."""
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
        if not admitted and record.tasks and self._signed(record.meta):
            for task in record.tasks:  # P may be back already: it frees the blocks now, not at the lease
                if self._claim_notice(task):
                    self._post_done(lane, record, task, False)
        return lane if admitted else None

    def _run_batch(self, lane: Lane, queued: list[tuple[DRequest, PullTask]]) -> None:
        """Read a batch of queued tasks of one P instance, then report each task.

        Per P rank: one lease check (per ``recv_batch_bytes``), one engine call per request, and a
        second lease check only after a read that ended past `LEASE_TRUST` of the promised lease. A
        failure fails only the tasks it concerns (a batch's read: that batch). A task of a request
        that timed out (or was replaced) meanwhile skips its read but still counts down and makes
        sure P gets a DONE, so neither side holds the request any longer.
        """
        by_port: dict[int, list[_Item]] = {}
        for pull, task in queued:
            item = _Item(pull, task, pull.meta.remote_port + task.global_rank)
            try:
                with self._lock:
                    item.live = self._requests.pulling(pull.request_id) is pull
                if not item.live:
                    item.ok = False
                elif not lane.passes(pull):
                    item.unsigned = not self._signed(pull.meta)  # its DONE goes only where P signed
                    raise PeerDown(f"P {pull.meta.remote_host}:{pull.meta.remote_port} is not answering")
                elif self._wanted(pull, task):
                    self._check_capability(pull.meta)  # before P is contacted or any byte is read
                    by_port.setdefault(item.port, []).append(item)
                    continue
                else:
                    item.contacted = False  # nothing to read: P is not asked
            except Exception as exc:
                item.fail(exc)
            self._finish(lane, item)
        for port, items in by_port.items():
            self._read_port(lane, port, items)

    def _read_port(self, lane: Lane, port: int, items: list[_Item]) -> None:
        """Plan, lease-check and read ``items`` (one P rank), in chunks of ``recv_batch_bytes``."""
        meta = items[0].pull.meta
        try:
            agent = self._peers.metadata(meta.remote_engine_id, rank_host(meta, port), port)
        except Exception as exc:
            for item in items:
                item.fail(exc)
                self._finish(lane, item)
            return
        # A P restarted on its ports may get its old transport port: connections left from the dead
        # one are still pooled and would fail the first reads.
        self._connections.adopt(rank_host(meta, port), agent.transport_ports, agent.owner)
        # Mooncake reads a session name a new P took through its first owner's descriptor.
        if self._sessions is not None:
            try:
                self._sessions.claim(agent.te_session, agent.owner, agent.transport_ports)
            except SessionReused as exc:
                for item in items:
                    item.fail(exc)
                    self._finish(lane, item)
                return
        planned: list[_Item] = []
        for item in items:
            try:
                item.batch = self._planner.task_descriptors(item.pull, item.task, item.port, agent)
                planned.append(item)
            except Exception as exc:
                item.fail(exc)
                self._finish(lane, item)
        chunk: list[_Item] = []
        size = 0
        for item in planned:
            assert item.batch is not None
            if chunk and size + item.batch.descriptors.total_bytes > self._config.recv_batch_bytes:
                self._read_chunk(lane, agent, chunk)
                chunk, size = [], 0
            chunk.append(item)
            size += item.batch.descriptors.total_bytes
        if chunk:
            self._read_chunk(lane, agent, chunk)

    def _read_chunk(self, lane: Lane, agent: AgentMetadata, chunk: list[_Item]) -> None:
        """One lease check for ``chunk`` (one P rank), then one engine read per request, each reported as it ends.

        A read that ended past `LEASE_TRUST` of the promised lease is checked again after it.
        """
        port = chunk[0].port
        host = rank_host(chunk[0].pull.meta, port)  # a P instance spanning nodes: this rank's node
        reading = chunk
        if logger.isEnabledFor(logging.DEBUG):  # the per-request timeline an operator asks for
            waited = [self._config.pull_timeout_s - (i.pull.deadline - self._clock()) for i in chunk]
            logger.debug(
                "reading %d task(s) from %s:%d: %s",
                len(chunk), host, port,
                ", ".join(f"{i.pull.request_id} (submitted {w:.3f} s ago)" for i, w in zip(chunk, waited, strict=True)),
            )  # fmt: skip
        try:
            # Before reading, P must confirm it still holds each request's blocks: params replayed
            # after D consumed them, or aimed at a request P already freed, would read reused blocks.
            asked = self._clock()
            held = self._peers.renew(host, port, self._leases(chunk), incarnation=agent.incarnation)
        except Exception as exc:
            for item in chunk:
                item.fail(exc)
                self._finish(lane, item)
            return
        reading, promised = [], []
        for item, lease in zip(chunk, held, strict=True):
            if lease is not None:
                reading.append(item)
                promised.append(lease)
            else:
                item.fail(NotHeld(f"P {host}:{port} holds no blocks for {item.pull.meta.remote_request_id!r}"))
                self._finish(lane, item)
        if not reading:
            return
        trusted_until = asked + LEASE_TRUST * min(promised)
        # One engine read per request, in turn, each reported as soon as its own read ends: the
        # first request of a batch does not wait for the batch's last byte.
        for start, group in _by_request(reading):
            try:
                self._read_held(agent, host, port, group, trusted_until)
            except Exception as exc:  # the batch's requests not read yet fail with it, unread
                for item in reading[start:]:
                    if item.ok:
                        item.fail(exc)
                    self._finish(lane, item)
                return
            for item in group:
                self._finish(lane, item)

    def _sender(self, task: PullTask) -> str:
        """``task``'s slot on P beside this rank: what its `Renew` binds and its DONE must name alike."""
        return done_sender(self._pcp_rank, task.shard)

    def _leases(self, items: Sequence[_Item]) -> list[LeaseAsk]:
        """What a `Renew` asks for ``items``: P's request id and grant, the task's DONE sender, the pull's token."""
        return [
            LeaseAsk(
                i.pull.meta.remote_request_id,
                pull_grant(i.pull.meta),
                self._sender(i.task),
                i.pull.reader,
            )
            for i in items
        ]

    def _read_held(
        self, agent: AgentMetadata, host: str, port: int, reading: list[_Item], trusted_until: float
    ) -> None:
        """Read the blocks P confirmed it holds; past ``trusted_until``, check P still held them throughout."""
        descriptors = Descriptors.concat([i.batch.descriptors for i in reading if i.batch is not None])
        deadline = min(i.pull.deadline for i in reading)
        source = (host, tuple(agent.transport_ports))
        with self._lock:
            for item in reading:
                item.pull.sources.add(source)
        started = self._clock()
        try:
            self._read(agent.te_session, descriptors, deadline, source)
            if logger.isEnabledFor(logging.DEBUG):  # total_bytes sums an array: not on every read
                logger.debug(
                    "read %d bytes in %d pieces from %s in %.1f ms",
                    descriptors.total_bytes, len(descriptors), agent.te_session, 1e3 * (self._clock() - started),
                )  # fmt: skip
        except BaseException:
            with self._lock:  # the engine may still write into these blocks: quarantine them
                for item in reading:
                    self._requests.hold(item.pull, self._clock() + self._config.quarantine_s)
            raise
        # A read that ended past the trusted share of the lease may have outlasted it: if P let the
        # blocks go meanwhile they may hold another request's bytes by now, so it counts only if P
        # still holds them after it. (P's entry for an id never comes back once freed, so "held"
        # now means held throughout.)
        if self._clock() >= trusted_until:
            held = self._peers.renew(host, port, self._leases(reading), incarnation=agent.incarnation)
            for item, lease in zip(reading, held, strict=True):
                if lease is None:
                    item.fail(NotHeld(f"P {host}:{port} released {item.pull.meta.remote_request_id!r} during the read"))
        with self._lock:
            for item in reading:
                if item.ok and item.batch is not None:
                    item.pull.pulled_layers.update(item.batch.layers)

    def _read(
        self, session: str, descriptors: Descriptors, deadline: float, source: tuple[str, tuple[int, ...]]
    ) -> None:
        """One engine read, tried again while a try fails at once on a connection D knows is dead.

        Mooncake pools its TCP connections per peer and drops one only when a transfer fails on it,
        so connections this process cut (`_cut`, or `PeerConnections.adopt` for a P's new session on
        an old port or one left from a process gone from it) fail the next reads at once although P
        is fine. Reading the same bytes into the same blocks again is harmless (the lease still
        decides whether they count). Any other failure (a dead P too) is not retried.
        """
        host, ports = source
        while True:
            started = self._clock()
            try:
                self._engine.read(session, descriptors, timeout_s=max(0.1, deadline - started))
                return
            except TransferTimeout:
                raise
            except TransferError as exc:
                now = self._clock()
                fast = now - started <= FAST_FAILURE_S and now < deadline
                if not (fast and self._connections.take_retry(host, ports)):
                    raise
                logger.warning("a read from %s failed on a connection D cut (%s); reading again", session, exc)

    def _cut(self, source: tuple[str, tuple[int, ...]], why: str) -> None:
        """Cut this process's connections to one P's transport.

        No pending receive of Mooncake's can write into D's blocks after this (it ends at once); its
        next transfer reconnects.
        """
        host, ports = source
        if not ports:
            logger.warning("%s; P named no transport port, so a late write cannot be ruled out", why)
            return
        cut = self._connections.sever(host, ports)
        logger.warning("%s; cut %d connection(s) to its transport %s:%s", why, cut, host, list(ports))

    def _finish(self, lane: Lane, item: _Item) -> None:
        """A task ended: record its failure, move the breaker, report the request, queue its DONE."""
        pull, meta = item.pull, item.pull.meta
        exc = item.error
        if exc is not None:  # every failure becomes load errors, never a crash
            host = rank_host(meta, item.port)
            logger.error("request %s: pull from %s:%d failed: %s", pull.request_id, host, item.port, exc)
            self._on_failure(exc)
            if not item.unsigned:  # P did nothing wrong: its metadata stays cached
                self._peers.forget(meta.remote_engine_id, host, item.port)
            self._fail(pull)
        # The breaker's verdict. A probe must always end, or every later request fails at once.
        if exc is not None and _peer_stopped_answering(exc):
            lane.failed(pull)
        elif item.live and item.contacted and (exc is None or isinstance(exc, NotHeld | PeerRestarted)):
            lane.answered(pull)  # P replied ("not held" included)
        else:  # nothing read, or failed before P was asked: proves nothing about P
            lane.release(pull)
        # Report the request first (D's latency), then release P's blocks with DONE (from the
        # lane's DONE thread, batched per P rank). Also while the lane is open: a P that came back
        # on its ports would otherwise hold the blocks of every request failed fast for the lease.
        self._task_done(pull)
        if self._claim_notice(item.task) and not item.unsigned:
            self._post_done(lane, pull, item.task, item.ok)

    def _wanted(self, pull: DRequest, task: PullTask) -> bool:
        """Whether D has any block of ``task`` to fill (if not, P is not asked)."""
        meta, shard = pull.meta, task.shard
        if shard >= 0:
            return any(gs[shard].local_ids for gs in pull.group_shards if gs)
        if shard == ShardKind.STATE_ONLY:
            return any(meta.local_block_ids[g] for g in self._cache.state_groups)
        return any(meta.local_block_ids)

    def _post_done(self, lane: Lane, pull: DRequest, task: PullTask, ok: bool) -> None:
        """Queue ``task``'s DONE on the lane's DONE thread, which sends what is queued per P rank."""
        meta = pull.meta
        item = DoneItem(
            request_id=meta.remote_request_id,
            ok=ok,
            sender=self._sender(task),
            grant=pull_grant(meta),
            reader=pull.reader,
        )
        port = meta.remote_port + task.global_rank
        with self._lock:
            outbox = self._outbox.setdefault(lane, [])
            outbox.append((rank_host(meta, port), port, item))
            first = len(outbox) == 1  # else a flush is already queued and will take this one
        if first:
            self._lanes.run(lane, lambda: self._flush_dones(lane), note=True)

    def _flush_dones(self, lane: Lane) -> None:
        """Send the lane's queued DONEs, one `Dones` list per P rank."""
        with self._lock:
            queued = self._outbox.pop(lane, [])
        by_rank: dict[tuple[str, int], list[DoneItem]] = {}
        for host, port, item in queued:
            by_rank.setdefault((host, port), []).append(item)
        for (host, port), items in by_rank.items():
            self._peers.send_dones(host, port, items)

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

    def _signed(self, meta: ReqMeta) -> bool:
        """Whether ``meta``'s params verify (or there is no secret): only then may D send its P a DONE."""
        try:
            self._check_capability(meta)
        except CapabilityRefused:
            return False
        return True

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
            stuck = self._requests.stuck(now)
            for pull in stuck:  # pieces Mooncake still queues for that P may land when the link returns
                self._requests.hold(pull, now + self._config.cut_hold_s)
            finished = self._requests.take_finished(now)
        for pull in stuck:  # a read outlived the deadline and the grace: end it, keep the blocks until it returns
            for source in sorted(pull.sources):
                self._cut(
                    source,
                    f"request {pull.request_id}: a read still runs {self._config.pull_timeout_s:.1f} s "
                    "after its deadline",
                )
        for pull in expired:
            self._lanes.get(self._key(pull.meta)).expired(pull)  # a probe that never ended: P did not answer
        for pull, task in notices:  # DONE (not ok): P frees the blocks now
            self._post_done(self._lanes.get(self._key(pull.meta)), pull, task, False)
        return finished

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
