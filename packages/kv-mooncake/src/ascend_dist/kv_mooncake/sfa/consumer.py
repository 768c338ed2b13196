"""D's worker half of the SFA remote-D2H connector: the read thread and completion.

Runs in: every D worker process. Call order: `ConsumerWorker.register` (after the host pool and
the indexer caches exist; binds the ROUTER at ``kv_port + dp_rank * D_tp + tp_rank``) ->
per step `start_load_kv` (destinations of newly allocated requests) -> `get_finished` and
`get_block_ids_with_load_errors` after the step -> `shutdown`.

The read thread (the `RpcServer`'s thread) serves P's messages in arrival order: a `Hello` is
checked (protocol, compatibility fields, every layer's block bytes and indexer presence) and
remembered per sender; a `ReadReady` is turned into descriptors (`plan.plan_request_reads`),
coalesced and read with one ``batch_transfer_sync_read`` (no attempt starts after P's
``read_budget_ms``, measured on D's clock from the frame's handling); D answers `ReadDone` (naming
requests it could not serve) or `ReadFailed`; a sender whose memory the engine failed to read is
forgotten (a killed P's entry goes with it; a live one greets again). A request is done when all
``tp_ratio`` contributors committed it (`Commit`: P's verdict, after its last layer's reads were
answered before P's deadline); it fails on a failed read, a refused layer, P's verdict, or when
nothing finished it within ``recv_timeout_s``. Failed block ids (main and indexer) are reported
at once; the request itself is reported finished ``quarantine_s`` later (a late engine write must
not land in reused blocks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ascend_dist.common.errors import AscendDistError, ConfigError, IncompatiblePeer
from ascend_dist.common.regions import RegisterRegions, validate_register_region_count
from ascend_dist.common.wire import Codec
from ascend_dist.common.zmq_server import RpcServer
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import Reader
from ascend_dist.kv_mooncake.core.messages import Refused, admit
from ascend_dist.kv_mooncake.core.session_owners import SESSION_OWNERS, SessionOwners, SessionReused
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.messages import (
    Commit,
    Committed,
    Hello,
    HelloAck,
    LayerMeta,
    ReadDone,
    ReadFailed,
    ReadReady,
    Reply,
    Request,
    reply_codec,
    request_codec,
)
from ascend_dist.kv_mooncake.sfa.plan import DestLayer, coalesce, plan_request_reads
from ascend_dist.kv_mooncake.sfa.producer import make_sfa_handshake
from ascend_dist.kv_mooncake.sfa.step_metadata import ConsumerMetadata, RecvReq

__all__ = ["ConsumerWorker"]

logger = logging.getLogger(__name__)

_GONE_MEMORY = 4096  # finished ext ids remembered, so late reads for them fail without waiting
_PEER_MEMORY = 1024  # greeted senders remembered (a P rank evicted is refused until it greets again)
# After a wait for destinations that never came, waits are skipped for this many times dest_wait_s:
# ReadReady frames naming unknown requests can park D's only read thread for at most ~1/5 of the time.
_VAIN_WAIT_BACKOFF = 4


@dataclass
class _Recv:
    req: RecvReq
    deadline: float
    contributors: set[int] = field(default_factory=set)
    done: bool = False
    error: str | None = None
    failed_at: float = 0.0


@dataclass(frozen=True)
class _Peer:
    session: str
    layers: dict[str, LayerMeta]
    owner: str = ""
    transport_ports: tuple[int, ...] = ()


class ConsumerWorker:
    """D's worker: destinations, the read thread, completion and load errors."""

    def __init__(
        self,
        config: SfaConfig,
        *,
        tp_rank: int,
        backend: Reader,
        clock: Callable[[], float] = time.monotonic,
        sessions: SessionOwners | None = SESSION_OWNERS,
    ) -> None:
        """Create the worker (the read thread starts in `register`).

        ``sessions``: which P process each Mooncake session was first read from in this process
        (`core.session_owners`; None where the engine refreshes a peer's descriptor itself).

        Raises:
            ConfigError: ``tp_rank`` out of range.
        """
        if not 0 <= tp_rank < config.decode.tp_size:
            raise ConfigError("tp_rank", tp_rank, f"an int in [0, {config.decode.tp_size})")
        self._config = config
        self._tp_rank = tp_rank
        self._backend = backend
        self._registered: RegisterRegions | None = None  # unregistered by shutdown
        self._clock = clock
        self._sessions = sessions
        self._requests: Codec[Request] = request_codec(config.max_message_bytes)
        self._replies: Codec[Reply] = reply_codec(config.max_message_bytes)
        self._dest: dict[str, DestLayer] = {}
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # least recently greeted first, bounded
        self._recv: dict[str, _Recv] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        self._no_wait_until = 0.0  # monotonic: see _VAIN_WAIT_BACKOFF
        self._errors: set[int] = set()
        self._failed_out: set[str] = set()
        self._cond = threading.Condition()
        self._server: RpcServer | None = None
        self.bytes_read = 0
        self.reads = 0
        self.received = 0
        self.trace: list[tuple[str, Descriptors]] | None = None  # the bench replays these reads

    @property
    def port(self) -> int:
        """This rank's side-channel port."""
        return self._config.d_base_port + self._tp_rank

    @property
    def pending(self) -> int:
        """Requests not yet reported finished."""
        with self._cond:
            return len(self._recv)

    def register(self, dest: Mapping[str, DestLayer], regions: Sequence[tuple[int, int]], layout: str = "NHD") -> None:
        """Register D's destinations and start the read thread.

        Args:
            dest: Main layer name -> destinations (host pool K/V, this rank's indexer tensors).
            regions: ``(ptr, size)`` memory regions to register (pool and indexer caches).
            layout: D's layout name (`producer.span_label`); P's must be the same.

        Raises:
            NativeLibraryError: The engine refused a region.
            ConfigError: The port is in use or the host is not local.
        """
        self._dest = dict(dest)
        mine = RegisterRegions(tuple(p for p, _ in regions), tuple(n for _, n in regions))
        validate_register_region_count(mine)
        self._backend.register(mine)
        self._registered = mine
        self._handshake = make_sfa_handshake(
            self._config, f"{self._config.engine_id}/d{self._tp_rank}", len(dest), layout
        )
        try:
            server = RpcServer(
                self._config.host,
                self.port,
                self._handle,
                max_bytes=self._config.max_message_bytes,
                name=f"sfa-read-d{self._tp_rank}",
            )
            server.start()
        except BaseException:  # a port in use, a foreign host: nothing of this start stays registered
            self._backend.unregister(mine)
            self._registered = None
            raise
        self._server = server

    def start_load_kv(self, meta: ConsumerMetadata) -> None:
        """Record the destinations of newly allocated requests (wakes a waiting read)."""
        now = self._clock()
        with self._cond:
            for r in meta.requests:
                self._gone.pop(r.ext_id, None)
                self._recv[r.ext_id] = _Recv(r, now + self._config.recv_timeout_s)
            self._cond.notify_all()

    # ---- read thread ------------------------------------------------------------------------

    def _handle(self, payload: bytes) -> bytes:
        with self._cond:
            self.received += 1
        try:
            msg = self._requests.decode(payload)
        except AscendDistError as exc:  # undecodable: answered, never fatal
            logger.warning("sfa D%d dropped a malformed message: %s", self._tp_rank, exc)
            return self._replies.encode(ReadFailed(layer_idx=-1, error=f"malformed message: {exc}"))
        if isinstance(msg, Hello):
            return self._replies.encode(self._hello(msg))
        if isinstance(msg, Commit):
            return self._replies.encode(self._commit(msg))
        try:
            reply = self._read_ready(msg)
        except Exception as exc:  # every failure becomes a reply, never a dead thread
            logger.exception("sfa D%d: layer %s failed", self._tp_rank, msg.layer_name)
            reply = ReadFailed(layer_idx=msg.layer_idx, error=f"{type(exc).__name__}: {exc}")
        return self._replies.encode(reply)

    def _hello(self, msg: Hello) -> HelloAck | Refused:
        refused = admit(self._handshake, self._config.engine_id, msg, lambda: self._check_layers(msg))
        if refused is not None:
            return refused
        with self._cond:
            self._peers[msg.sender] = _Peer(msg.session, dict(msg.layers), msg.owner, tuple(msg.transport_ports))
            self._peers.move_to_end(msg.sender)
            while len(self._peers) > _PEER_MEMORY:  # P restarts bring new sender names
                self._peers.popitem(last=False)
        return HelloAck(receiver=f"{self._config.engine_id}/d{self._tp_rank}")

    def _check_layers(self, msg: Hello) -> None:
        """P's layers must match D's destinations block for block (raises `IncompatiblePeer`)."""
        for name, dest in self._dest.items():
            layer = msg.layers.get(name)
            if layer is None:
                raise IncompatiblePeer(f"layer {name}", "present", "missing")
            main = tuple(s.block_bytes for s in layer.main)
            if main != dest.main_block_bytes:
                raise IncompatiblePeer(f"{name} main block bytes", dest.main_block_bytes, main)
            idx = tuple(s.block_bytes for s in layer.indexer)
            if idx != dest.indexer_block_bytes:
                raise IncompatiblePeer(f"{name} indexer block bytes", dest.indexer_block_bytes, idx)

    def _wait_records(self, ext_ids: Sequence[str]) -> dict[str, _Recv]:
        """Records of ``ext_ids``, waiting up to ``dest_wait_s`` for D's own step to bring them.

        Ids still missing after a wait are remembered as gone (a repeat fails at once), and for
        `_VAIN_WAIT_BACKOFF` times ``dest_wait_s`` after such a wait nothing waits: frames naming
        requests D never gets cannot keep its read thread parked.
        """
        start = time.monotonic()
        wait_s = self._config.dest_wait_s
        with self._cond:
            deadline = start + (wait_s if start >= self._no_wait_until else 0.0)
            while True:
                missing = [e for e in ext_ids if e not in self._recv and e not in self._gone]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    break
                self._cond.wait(left)
            if missing and deadline > start:
                self._no_wait_until = time.monotonic() + _VAIN_WAIT_BACKOFF * wait_s
            for ext in missing:
                self._gone[ext] = None
            while len(self._gone) > _GONE_MEMORY:
                self._gone.popitem(last=False)
            return {e: self._recv[e] for e in ext_ids if e in self._recv}

    def _read_ready(self, msg: ReadReady) -> ReadDone | ReadFailed:
        give_up_at = time.monotonic() + msg.read_budget_ms / 1000 if msg.read_budget_ms > 0 else float("inf")
        peer = self._peers.get(msg.sender)
        if peer is None:
            return ReadFailed(layer_idx=msg.layer_idx, error=f"no hello from {msg.sender} before its reads")
        p_layer, dest = peer.layers.get(msg.layer_name), self._dest.get(msg.layer_name)
        if p_layer is None or dest is None:
            return self._fail_batch(msg, f"layer {msg.layer_name} unknown on {'P' if p_layer is None else 'D'}")
        with self._cond:  # finished or aborted here before: expected, not worth a warning per layer
            ended = {r.ext_id for r in msg.reads if r.ext_id in self._gone}
        records = self._wait_records([r.ext_id for r in msg.reads])
        failed: list[str] = []
        parts: list[Descriptors] = []
        served: list[str] = []
        for r in msg.reads:
            rec = records.get(r.ext_id)
            if rec is None or rec.error is not None:
                failed.append(r.ext_id)
                if rec is None and r.ext_id not in ended:
                    logger.warning("sfa D%d: no destination for request %s", self._tp_rank, r.ext_id)
                continue
            try:
                plan = plan_request_reads(
                    p_main=[(s.base, s.block_bytes) for s in p_layer.main],
                    p_indexer=[(s.base, s.block_bytes) for s in p_layer.indexer],
                    dest=dest,
                    p_main_ids=r.p_main_ids,
                    p_indexer_ids=r.p_indexer_ids,
                    main_start=r.main_start,
                    indexer_start=r.indexer_start,
                    d_main_ids=rec.req.main_block_ids,
                    d_indexer_ids=rec.req.indexer_block_ids or rec.req.main_block_ids,
                    d_tp_rank=self._tp_rank,
                    d_tp=self._config.decode.tp_size,
                    member=msg.group_member_idx,
                    ratio=msg.tp_ratio,
                )
            except ConfigError as exc:
                self._fail([r.ext_id], f"layer {msg.layer_name}: {exc}")
                failed.append(r.ext_id)
                continue
            parts.append(plan.descriptors)
            served.append(r.ext_id)
        batch = Descriptors.concat(parts) if parts else None
        if batch is not None and len(batch):
            batch = coalesce(np.asarray(batch.local), np.asarray(batch.remote), np.asarray(batch.lengths))
            error, engine_failed = self._read(peer, batch, msg.layer_name, give_up_at)
            if error is not None:
                if engine_failed:
                    self._forget(msg.sender, peer.session)
                self._fail([*served, *msg.done_ext_ids], f"layer {msg.layer_name}: {error}")
                return ReadFailed(layer_idx=msg.layer_idx, error=error)
            with self._cond:
                self.bytes_read += batch.total_bytes
                self.reads += 1
                if self.trace is not None:
                    self.trace.append((peer.session, batch))
        return ReadDone(layer_idx=msg.layer_idx, failed=failed)

    def _read(self, peer: _Peer, batch: Descriptors, layer_name: str, give_up_at: float) -> tuple[str | None, bool]:
        """One batch read from ``peer``'s session, repeated ``read_retries`` times on failure.

        No attempt starts after ``give_up_at`` (P's read budget): P would not take its answer. None
        starts when this process's engine knows the session as another P process's on other
        transport ports (`core.session_owners`: Mooncake would read through the dead one's descriptor).

        Returns:
            ``(None, False)`` when read; else the last error and whether the engine failed a read
            of the session (False: the budget passed before the first attempt, or the session was refused).
        """
        try:
            if self._sessions is not None:
                self._sessions.claim(peer.session, peer.owner, peer.transport_ports)
        except SessionReused as exc:
            return str(exc), False
        session = peer.session
        error = ""
        for attempt in range(self._config.read_retries + 1):
            if time.monotonic() >= give_up_at:
                return error or "P's read budget passed before D could start the read", bool(error)
            try:
                if len(batch):
                    self._backend.read(session, batch)
                return None, False
            except AscendDistError as exc:
                error = str(exc)
                if attempt < self._config.read_retries:
                    logger.warning("sfa D%d: read of %s failed (%s); retrying", self._tp_rank, layer_name, exc)
        return error, True

    def _forget(self, sender: str, session: str) -> None:
        """Drop a sender whose memory could not be read: a dead P's entry must not outlive it.

        A P that is alive greets again before its next read (its link re-greets after a `ReadFailed`).
        """
        with self._cond:
            peer = self._peers.get(sender)
            if peer is not None and peer.session == session:
                del self._peers[sender]

    def _commit(self, msg: Commit) -> Committed:
        """P's verdict: count its contribution to ``ext_ids``; fail ``failed_ext_ids`` now."""
        if msg.sender not in self._peers:
            return Committed(failed=list(msg.ext_ids))
        if msg.failed_ext_ids:
            self._fail(msg.failed_ext_ids, f"P ({msg.sender}) gave up on a read of it (its deadline or D's failure)")
        refused: list[str] = []
        with self._cond:
            for ext in msg.ext_ids:
                rec = self._recv.get(ext)
                if rec is None or rec.error is not None:
                    refused.append(ext)
                    continue
                rec.contributors.add(msg.group_member_idx)
                if len(rec.contributors) >= msg.tp_ratio:
                    rec.done = True
        return Committed(failed=refused)

    def _fail_batch(self, msg: ReadReady, reason: str) -> ReadFailed:
        self._fail([*(r.ext_id for r in msg.reads), *msg.done_ext_ids], reason)
        return ReadFailed(layer_idx=msg.layer_idx, error=reason)

    def _fail(self, ext_ids: Sequence[str], reason: str) -> None:
        now = self._clock()
        with self._cond:
            for ext in ext_ids:
                rec = self._recv.get(ext)
                if rec is None or rec.error is not None or rec.done:
                    continue
                rec.error, rec.failed_at = reason, now
                self._errors.update(rec.req.main_block_ids)
                self._errors.update(rec.req.indexer_block_ids)
                logger.error("sfa D%d: request %s failed: %s", self._tp_rank, ext, reason)

    # ---- step hooks -------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str] | None = None) -> tuple[set[str], set[str]]:
        """``(set(), finished_recving)``: done requests, and failed ones after their quarantine.

        Args:
            finished_req_ids: Requests vLLM finished (aborted) this step: forgotten after this
                step's signals were resolved.
        """
        now = self._clock()
        expired = [e for e, r in self._snapshot() if not r.done and r.error is None and now >= r.deadline]
        if expired:
            self._fail(expired, f"not received within recv_timeout_s={self._config.recv_timeout_s}")
        out: set[str] = set()
        with self._cond:
            for ext, rec in list(self._recv.items()):
                ready = rec.done if rec.error is None else now >= rec.failed_at + self._config.quarantine_s
                aborted = finished_req_ids is not None and rec.req.request_id in finished_req_ids
                if ready or aborted:
                    if ready:
                        out.add(rec.req.request_id)
                        if rec.error is not None:
                            self._failed_out.add(rec.req.request_id)
                    del self._recv[ext]
                    self._gone[ext] = None
                    while len(self._gone) > _GONE_MEMORY:
                        self._gone.popitem(last=False)
        return set(), out

    def _snapshot(self) -> list[tuple[str, _Recv]]:
        with self._cond:
            return list(self._recv.items())

    def take_failed_recving(self) -> set[str]:
        """Requests reported finished since the last call whose load failed (vLLM's ``failed_recving``)."""
        with self._cond:
            out, self._failed_out = self._failed_out, set()
            return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids (main and indexer groups) of failed requests, reported once, at the failure."""
        with self._cond:
            out, self._errors = self._errors, set()
            return out

    def shutdown(self) -> None:
        """Stop and join the read thread, drop the registration. Idempotent."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._registered is not None:
            self._backend.unregister(self._registered)
            self._registered = None
