"""P's send thread: writes each saved layer into D's blocks; a notifier thread then signals D.

Runs in: P worker processes. The forward thread queues one `SendTask` per saved layer (after closing
the layer's reuse gate). The send thread, in order:

1. builds the layer's descriptors per D session and calls ``batch_transfer_sync_write`` once per
   session (split at 2,048 pieces); a failure marks that session's requests failed (no more
   layers are pushed for them) and drops D's cached metadata;
2. opens the layer's reuse gate, with the error if any, returns the staging slot, and hands the
   task to the notifier (so the next layer's write never waits for D's acknowledgement).

The notifier thread, in the same FIFO order:

3. sends `LayerDone` to each D endpoint, one message for every layer written since its last one
   (D's ``wait_for_layer_load`` and its per-layer deadline use it); ids D answers ``unknown``
   (D gave up on them) are marked failed too;
4. after a request's last layer: `Done` (``ok``, or failed with the reason) to every D endpoint
   that waits for this rank; delivery is bounded by the RPC deadline and never raises.

The threads own no request state beyond the failure marks; `SendThread.close` joins both.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ascend_dist.common.errors import AscendDistError, IncompatiblePeer, TransferError
from ascend_dist.common.wire import Codec, Handshake
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.core.engine import Writer
from ascend_dist.kv_mooncake.core.messages import Ack, AgentMetadata, GetMeta, MetaReply, TensorMeta, accept_reply
from ascend_dist.kv_mooncake.core.session_owners import SESSION_OWNERS, SessionOwners
from ascend_dist.kv_mooncake.core.transfer_mappings import Endpoint
from ascend_dist.kv_mooncake.push.gate import ReuseGate
from ascend_dist.kv_mooncake.push.messages import Claim, LayerDone, PushDone, Reply, Request
from ascend_dist.kv_mooncake.push.plan import Pieces, block_runs, plain_pieces, resharded_pieces

__all__ = ["MetaCache", "SendTask", "SendThread", "WriteItem"]

logger = logging.getLogger(__name__)

FAILED_MEMORY = 65536  # failed requests remembered per P rank
CLAIMS_MEMORY = 65536  # (endpoint, request) claims remembered per P rank (dropped with the request's Done)

_MAX_COALESCED = 64  # layers one notification may cover when the notifier lags behind the writes


class MetaCache:
    """D workers' metadata by endpoint, fetched once with P's handshake (``GetMeta``).

    Each answer is first checked against the Mooncake sessions this process already wrote to
    (`core.session_owners`): P's engine keeps a D's segment descriptor per session name for its
    life, so a D restarted on a dead D's Mooncake RPC port but another transport port would be
    written through the dead one's descriptor (to a port nobody or another process listens on).
    """

    def __init__(
        self,
        client: RpcClient,
        requests: Codec[Request],
        replies: Codec[Reply],
        handshake: Handshake,
        engine_id: str,
        *,
        sessions: SessionOwners | None = SESSION_OWNERS,
    ) -> None:
        """Create an empty cache (``sessions``: None where the engine refreshes a peer's descriptor itself)."""
        self._client, self._requests, self._replies = client, requests, replies
        self._handshake, self._engine_id = handshake, engine_id
        self._sessions = sessions
        self._cache: dict[Endpoint, AgentMetadata] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: Endpoint, engine_id: str = "") -> AgentMetadata:
        """D's metadata at ``endpoint``.

        ``engine_id``: the D engine the caller expects there; metadata cached for another engine is
        fetched again (a D restarted on these ports draws a new engine id at each start).

        Raises:
            IncompatiblePeer: D refused our handshake, or has our engine id, or its handshake differs.
            DeadlineExceeded: D did not answer.
            ProtocolError: D's reply is malformed.
            SessionReused: D's Mooncake session is one this process's engine wrote to as another
                process, on other transport ports (checked on every call: nothing is written there).
        """
        with self._lock:
            hit = self._cache.get(endpoint)
        if hit is None or (engine_id and hit.engine_id != engine_id):
            payload = self._requests.encode(GetMeta(handshake=self._handshake, engine_id=self._engine_id))
            raw = self._replies.decode(self._client.request(tcp_endpoint(endpoint.host, endpoint.port), payload))
            reply = accept_reply(raw, MetaReply, self._handshake, f"D {endpoint}")
            if reply.metadata.engine_id == self._engine_id:
                raise IncompatiblePeer("engine_id", self._engine_id, reply.metadata.engine_id)
            hit = reply.metadata
            with self._lock:
                self._cache[endpoint] = hit
        if self._sessions is not None:
            self._sessions.claim(hit.te_session, hit.owner, hit.transport_ports)
        return hit

    def forget_other_worker(self, endpoint: Endpoint, incarnation: str) -> str | None:
        """Drop the metadata at ``endpoint`` if it names another D worker than ``incarnation``.

        Returns the dropped worker's incarnation, or None (nothing cached, the same worker, or
        metadata from a D that does not name its worker).
        """
        with self._lock:
            hit = self._cache.get(endpoint)
            if hit is None or not hit.incarnation or hit.incarnation == incarnation:
                return None
            del self._cache[endpoint]
            return hit.incarnation

    def invalidate(self, endpoint: Endpoint) -> None:
        """Forget an endpoint (after a failed transfer: D may have restarted)."""
        with self._lock:
            self._cache.pop(endpoint, None)


@dataclass(frozen=True)
class WriteItem:
    """One request's writes of one layer to one D endpoint."""

    transfer_id: str
    endpoint: Endpoint
    session: str
    local: Sequence[TensorMeta]
    remote: Sequence[TensorMeta]
    local_ids: Sequence[int]
    remote_ids: Sequence[int]
    trans_count: int
    staging: Sequence[int] = ()
    member: int = 0
    ratio: int = 1

    def pieces(self) -> Pieces:
        """Plain or resharded pieces of this item (the send thread's per-layer hot path)."""
        if self.ratio > 1:
            return resharded_pieces(
                self.staging,
                self.local,
                self.remote,
                self.local_ids,
                self.remote_ids,
                member=self.member,
                ratio=self.ratio,
            )
        return plain_pieces(self.local, self.remote, block_runs(self.local_ids, self.remote_ids))


@dataclass
class SendTask:
    """One saved layer: its writes, and the requests whose last layer it is."""

    layer: int
    items: list[WriteItem] = field(default_factory=list)
    finished: list[tuple[str, tuple[tuple[Endpoint, int], ...]]] = field(default_factory=list)
    release: Callable[[], None] | None = None
    ready: Callable[[], None] | None = None  # waits for the device event after the layer's KV write


class SendThread:
    """The P worker's background pusher (one per worker)."""

    def __init__(
        self,
        engine: Writer,
        *,
        client: RpcClient,
        requests: Codec[Request],
        replies: Codec[Reply],
        gate: ReuseGate,
        metas: MetaCache,
        sender: str,
        transfer_timeout_s: float,
        queue_size: int = 0,
        claim_ttl_s: float = 0.0,
    ) -> None:
        """Start the thread.

        Args:
            engine: The push engine.
            client: Side-channel client (LayerDone / Done).
            requests: Codec of P -> D messages.
            replies: Codec of D's replies.
            gate: The reuse gate to open after each layer.
            metas: D metadata cache (invalidated on a failed write).
            sender: This rank's identity in DONEs (``"<host>:<engine session>"``, unique per rank).
            transfer_timeout_s: Deadline of one layer's writes to one session.
            queue_size: Bound on queued layers (0 = unbounded).
            claim_ttl_s: A write needs a claim on its request sent at most this long ago, else the
                claim is renewed first (D may have given up meanwhile). D holds a request it gave up on
                for its ``fence_timeout_s`` after the latest claim it accepted, so half of it leaves
                the write that long to land. 0: claims never age (tests of other parts).
        """
        self._engine, self._client = engine, client
        self._requests, self._replies = requests, replies
        self._gate, self._metas = gate, metas
        self._sender = sender
        self._timeout_s = transfer_timeout_s
        self._queue: queue.Queue[SendTask | None] = queue.Queue(maxsize=queue_size)
        # Popped when the request's last layer is notified; bounded, as an aborted request never gets there.
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._claim_ttl_s = claim_ttl_s
        self._claims: OrderedDict[tuple[Endpoint, str], float] = OrderedDict()  # -> monotonic when sent
        self._lock = threading.Lock()
        # Notifications run on their own thread (FIFO, so a request's Done follows its LayerDones):
        # the next layer's write never waits for D's acknowledgement of the previous one.
        self._notes: queue.Queue[SendTask | None] = queue.Queue()
        self._notifier = threading.Thread(target=self._notify_loop, name=f"lw-notify-{sender}", daemon=True)
        self._notifier.start()
        self._thread = threading.Thread(target=self._run, name=f"lw-send-{sender}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread.is_alive()

    def mark_failed(self, transfer_id: str, reason: str) -> None:
        """Stop pushing a request; its `Done` will report the failure."""
        with self._lock:
            self._failed.setdefault(transfer_id, reason)
            while len(self._failed) > FAILED_MEMORY:
                self._failed.popitem(last=False)

    @property
    def failures_kept(self) -> int:
        """Failed requests remembered (bounded by `FAILED_MEMORY`)."""
        with self._lock:
            return len(self._failed)

    @property
    def claims_kept(self) -> int:
        """Claims remembered (each dropped with its request's Done; bounded by `CLAIMS_MEMORY`)."""
        with self._lock:
            return len(self._claims)

    def failure(self, transfer_id: str) -> str | None:
        """Why a request failed on this rank, or None."""
        with self._lock:
            return self._failed.get(transfer_id)

    def claim(self, endpoint: Endpoint, transfer_ids: Sequence[str]) -> None:
        """Tell D this rank is about to write these requests (the forward thread, before the step's writes).

        Ids D answers ``unknown`` (it gave up on them; vLLM may be recomputing into their blocks) and
        every id when D does not answer are marked failed, so nothing of them is written. So is
        every id when the D worker answering is not the one whose metadata P writes with (a D
        restarted on these ports, its engine id pinned): the metadata is dropped, so the next
        step's requests fetch the new worker's.
        """
        sent = time.monotonic()  # D received it later: its hold counts from then
        reply = self._call(endpoint, Claim(sender=self._sender, request_ids=list(transfer_ids)))
        if reply is None:
            for tid in transfer_ids:
                self.mark_failed(tid, f"D {endpoint.host}:{endpoint.port} unreachable")
        elif not isinstance(reply, Ack):
            for tid in transfer_ids:
                self.mark_failed(tid, f"D {endpoint.host}:{endpoint.port} answered a claim with {type(reply).__name__}")
        elif (dead := self._metas.forget_other_worker(endpoint, reply.incarnation)) is not None:
            reason = (
                f"D {endpoint.host}:{endpoint.port} restarted since P fetched its metadata (worker "
                f"{dead}, now {reply.incarnation or 'unnamed'}): not written, metadata fetched again"
            )
            logger.warning("%s", reason)
            for tid in transfer_ids:
                self.mark_failed(tid, reason)
        else:
            for tid in reply.unknown:
                self.mark_failed(tid, "D no longer waits for the request")
            with self._lock:
                for tid in set(transfer_ids) - set(reply.unknown):
                    self._claims[(endpoint, tid)] = sent
                    self._claims.move_to_end((endpoint, tid))
                while len(self._claims) > CLAIMS_MEMORY:
                    self._claims.popitem(last=False)

    def end(self, transfer_id: str, done_to: Sequence[tuple[Endpoint, int]], reason: str) -> None:
        """The request ended on P before its last chunk: queue a failed `PushDone` to each D in ``done_to``.

        Queued behind the layers already submitted (FIFO through both threads), so D hears it after
        their notices; nothing more of the request is written.
        """
        self.mark_failed(transfer_id, reason)
        if not self.alive:
            raise TransferError("send thread is not running")
        try:  # empty after `plan_step`'s wait for every queued layer; bounded all the same
            self._queue.put(SendTask(layer=-1, finished=[(transfer_id, tuple(done_to))]), timeout=self._timeout_s)
        except queue.Full:
            logger.error("request %s: its failed Done was not queued; D fails it at its deadline", transfer_id)

    def submit(self, task: SendTask, timeout_s: float) -> None:
        """Queue a layer (the gate must already be closed).

        Raises:
            TransferError: The thread is not running.
        """
        if not self.alive:
            raise TransferError("send thread is not running")
        self._queue.put(task, timeout=timeout_s)

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                self._notes.put(None)
                return
            error: str | None = None
            try:
                if task.ready is not None:
                    task.ready()  # the bytes are in memory only once the compute stream got there
                error = self._write(task)
            except Exception as exc:  # never let one layer kill the pusher; the layer's requests fail
                logger.exception("layer %d: push failed unexpectedly", task.layer)
                error = f"{type(exc).__name__}: {exc}"
                for item in task.items:
                    self.mark_failed(item.transfer_id, error)
            finally:
                if task.release is not None:
                    task.release()
                if task.layer >= 0:  # an early end (`end`) has no layer
                    self._gate.complete(task.layer, error)
                self._notes.put(task)

    def _notify_loop(self) -> None:
        while True:
            tasks = [self._notes.get()]
            while len(tasks) < _MAX_COALESCED and tasks[-1] is not None:  # catch up: one message for many layers
                try:
                    tasks.append(self._notes.get_nowait())
                except queue.Empty:
                    break
            stop = tasks[-1] is None
            try:
                self._notify([t for t in tasks if t is not None])
            except Exception:  # a notification failure is logged; D's deadline covers the request
                logger.exception("notifying D failed unexpectedly")
            if stop:
                return

    def _notify(self, tasks: list[SendTask]) -> None:
        self._notify_layers(tasks)
        for task in tasks:
            for tid, done_to in task.finished:
                with self._lock:
                    reason = self._failed.pop(tid, None)
                    for endpoint, _ in done_to:
                        self._claims.pop((endpoint, tid), None)
                for endpoint, count in done_to:
                    done = PushDone(
                        sender=self._sender, request_id=tid, trans_count=count, ok=reason is None, reason=reason or ""
                    )
                    self._send_done(endpoint, done)

    def _renew_claims(self, items: Sequence[WriteItem]) -> None:
        """Renew each claim older than ``claim_ttl_s`` before writing (a stalled forward: D may have given up)."""
        if not self._claim_ttl_s:
            return
        now = time.monotonic()
        stale: dict[Endpoint, list[str]] = {}
        with self._lock:
            for item in items:
                sent = self._claims.get((item.endpoint, item.transfer_id))
                if sent is None or now - sent > self._claim_ttl_s:
                    ids = stale.setdefault(item.endpoint, [])
                    if item.transfer_id not in ids:
                        ids.append(item.transfer_id)
        for endpoint, ids in stale.items():
            live = [tid for tid in ids if self.failure(tid) is None]
            if live:
                self.claim(endpoint, live)  # ids D gave up on are marked failed: not written

    def _write(self, task: SendTask) -> str | None:
        self._renew_claims(task.items)
        by_session: dict[str, list[WriteItem]] = {}
        for item in task.items:
            if self.failure(item.transfer_id) is None:
                by_session.setdefault(item.session, []).append(item)
        error = None
        for session, items in by_session.items():
            try:
                lo: list[int] = []
                ro: list[int] = []
                ln: list[int] = []
                for item in items:
                    a, b, c = item.pieces()
                    lo += a
                    ro += b
                    ln += c
                self._engine.write(session, (lo, ro, ln), timeout_s=self._timeout_s)
            except AscendDistError as exc:
                error = f"layer {task.layer} to {session}: {exc}"
                logger.error("push failed: %s", error)
                for item in items:
                    self.mark_failed(item.transfer_id, error)
                    self._metas.invalidate(item.endpoint)
        return error

    def _notify_layers(self, tasks: list[SendTask]) -> None:
        """One `LayerDone` per (endpoint, count, request set) covering every layer of ``tasks``."""
        groups: dict[tuple[Endpoint, int, tuple[str, ...]], list[int]] = {}
        for task in tasks:
            per: dict[tuple[Endpoint, int], list[str]] = {}
            for item in task.items:
                if self.failure(item.transfer_id) is None:
                    ids = per.setdefault((item.endpoint, item.trans_count), [])
                    if item.transfer_id not in ids:
                        ids.append(item.transfer_id)
            for (endpoint, count), ids in per.items():
                groups.setdefault((endpoint, count, tuple(ids)), []).append(task.layer)
        for (endpoint, count, ids), layers in groups.items():
            msg = LayerDone(sender=self._sender, layers=layers, request_ids=list(ids), trans_count=count)
            reply = self._call(endpoint, msg)
            if reply is None:
                for tid in ids:
                    self.mark_failed(tid, f"D {endpoint.host}:{endpoint.port} unreachable")
            elif isinstance(reply, Ack):
                for tid in reply.unknown:
                    self.mark_failed(tid, "D no longer waits for the request")

    def _send_done(self, endpoint: Endpoint, msg: PushDone) -> None:
        if self._call(endpoint, msg) is None:
            logger.error("request %s: could not deliver DONE to %s:%d", msg.request_id, endpoint.host, endpoint.port)

    def _call(self, endpoint: Endpoint, msg: Request) -> Reply | None:
        try:
            raw = self._client.request(tcp_endpoint(endpoint.host, endpoint.port), self._requests.encode(msg))
            return self._replies.decode(raw)
        except AscendDistError as exc:
            logger.warning("side channel to %s:%d failed: %s", endpoint.host, endpoint.port, exc)
            return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued layers and notifications, stop and join both threads. Idempotent."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout_s)
            except queue.Full:
                logger.error("send thread queue still full at shutdown")
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("send thread did not stop within %.1f s", timeout_s)
        elif self._notifier.is_alive():
            self._notifier.join(timeout_s)
