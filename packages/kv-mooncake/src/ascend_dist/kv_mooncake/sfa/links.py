"""P's send side: one thread per D endpoint, the layer-done signals, and the reuse gates.

Runs in: P worker processes. `Dispatcher.dispatch` (called on the compute thread when a layer's
KV is written) closes the layer's reuse gates and queues one `Part` per D endpoint; the endpoint's
`_Link` thread waits for the layer's write event, sends `Hello` the first time, then `ReadReady`,
and waits (bounded by ``read_timeout_s``) for D's `ReadDone`/`ReadFailed`. Each part is resolved
exactly once (reply, deadline, dead endpoint or shutdown) and then releases its share of the
layer's gates; a failure marks its requests failed on P (logged; D reports its own load errors).
An endpoint that missed a deadline is skipped for ``endpoint_retry_s`` (its parts fail at once
instead of stalling every layer), then greeted again; so is one that answered `ReadFailed` (D
forgets a sender it could not read).

After the answer to a part that ends requests (its ``done_ext_ids``), the link sends D a
`Commit`: the requests every one of whose parts to this endpoint was answered in time count as
received; those P gave up on (any part failed: deadline, endpoint down, D's failure) are failed
at once. A `ReadDone` that arrives after P's deadline is dropped with the socket, so D never
counts a read P did not wait for.

Threads own no business state beyond their queue; `shutdown` joins every thread and resolves
every queued part, so no gate stays closed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ascend_dist.common.errors import DeadlineExceeded, ProtocolError
from ascend_dist.common.wire import Codec
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.core.messages import accept_reply
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.messages import (
    Commit,
    Committed,
    Hello,
    HelloAck,
    ReadDone,
    ReadFailed,
    ReadReady,
    Reply,
    Request,
    reply_codec,
    request_codec,
)

__all__ = ["FAILURES_KEPT", "Dispatcher", "Part", "Slot"]

logger = logging.getLogger(__name__)

# Requests a part failed for, remembered until their last part was committed or refused; bounded
# because an aborted request never reaches its last part.
_VOIDED_MEMORY = 65536
# Failures kept for `Dispatcher.take_failed` (the most recent): vLLM's connector never takes them
# (each is logged when it happens), so they must not pile up for a collector that never comes.
FAILURES_KEPT = 512


class Slot:
    """A reuse gate: open when no dispatched read of its storage is outstanding."""

    def __init__(self) -> None:
        """Create an open gate."""
        self.event = threading.Event()
        self.event.set()
        self.pending = 0
        self.error: str | None = None


@dataclass
class Part:
    """One layer's read request to one D endpoint."""

    endpoint: tuple[str, int]
    message: ReadReady
    slots: list[Slot]
    ready: Callable[[], None] | None = None
    resolved: bool = False
    ext_ids: list[str] = field(default_factory=list)
    engine_id: str = ""  # the D engine the requests' contacts name ("": not checked)


class _Link(threading.Thread):
    """The thread talking to one D endpoint, in dispatch order."""

    def __init__(self, owner: Dispatcher, endpoint: tuple[str, int]) -> None:
        super().__init__(name=f"sfa-send-{endpoint[0]}:{endpoint[1]}", daemon=True)
        self.owner = owner
        self.endpoint = endpoint
        self.queue: queue.Queue[Part | None] = queue.Queue()
        self.greeted = False
        self.down_until = 0.0
        self.receiver_engine = ""  # the engine id D answered the hello with

    def run(self) -> None:
        while True:
            part = self.queue.get()
            if part is None:
                return
            try:
                self._serve(part)
            except Exception as exc:  # a broken part must not kill the link
                logger.exception("sfa send to %s failed unexpectedly", self.endpoint)
                self.owner.resolve(part, f"{type(exc).__name__}: {exc}")

    def _serve(self, part: Part) -> None:
        o = self.owner
        if part.ready is not None:
            part.ready()  # the layer's KV write has landed (device event)
        if time.monotonic() < self.down_until:
            o.resolve(part, f"endpoint {self.endpoint} is down (missed a deadline); retrying after it recovers")
            return
        try:
            if not self.greeted or (part.engine_id and part.engine_id != self.receiver_engine):
                # First contact, or (another engine id) a D restarted on these ports: vLLM draws a
                # new engine id at each start, so ask who answers there before refusing.
                self._hello()
            if part.engine_id and part.engine_id != self.receiver_engine:
                # Another D answers at the contact's (unsigned) host and port: its live request of the
                # same id must not read this P's bytes. It is told nothing (no commit).
                o.resolve(part, f"D at {self.endpoint} is {self.receiver_engine!r}, not {part.engine_id!r}")
                return
            reply = o.call(self.endpoint, part.message, o.config.read_timeout_s)
        except (DeadlineExceeded, ProtocolError) as exc:
            self.greeted = False
            if isinstance(exc, DeadlineExceeded):
                self.down_until = time.monotonic() + o.config.endpoint_retry_s
            o.resolve(part, f"{type(exc).__name__}: {exc}")
            if part.message.done_ext_ids and time.monotonic() >= self.down_until:
                self._commit(part.message)  # fail them on D now rather than at its recv_timeout_s
            return
        if isinstance(reply, ReadDone):
            o.resolve(part, None, failed=reply.failed)
        elif isinstance(reply, ReadFailed):
            self.greeted = False  # D may have forgotten this sender (it could not read it): greet again
            o.resolve(part, f"D failed layer {reply.layer_idx}: {reply.error}")
        else:
            o.resolve(part, f"unexpected reply {type(reply).__name__}")
        if part.message.done_ext_ids:
            self._commit(part.message)

    def _commit(self, ready: ReadReady) -> None:
        """Tell D which of ``ready``'s finished requests count: those no part failed for."""
        o = self.owner
        counted, failed = o.verdict(ready.done_ext_ids)
        commit = Commit(
            sender=ready.sender,
            ext_ids=counted,
            failed_ext_ids=failed,
            group_member_idx=ready.group_member_idx,
            tp_ratio=ready.tp_ratio,
        )
        try:
            reply = o.call(self.endpoint, commit, o.config.read_timeout_s)
        except (DeadlineExceeded, ProtocolError) as exc:
            # D never counts these: it fails them at its recv_timeout_s.
            self.greeted = False
            o.mark_failed(counted, f"commit to {self.endpoint} failed: {type(exc).__name__}: {exc}")
            return
        if not isinstance(reply, Committed):
            o.mark_failed(counted, f"unexpected reply to commit: {type(reply).__name__}")
        elif reply.failed:
            o.mark_failed(reply.failed, "D had failed the request before P's commit")

    def _hello(self) -> None:
        o = self.owner
        hello = o.hello()
        ack = accept_reply(
            o.call(self.endpoint, hello, o.config.hello_timeout_s), HelloAck, hello.handshake, str(self.endpoint)
        )
        self.receiver_engine = ack.receiver.rsplit("/d", 1)[0]  # "<engine id>/d<tp rank>"
        self.greeted = True


class Dispatcher:
    """P's endpoint links, gate accounting and failure marking."""

    def __init__(self, config: SfaConfig, hello: Callable[[], Hello]) -> None:
        """Create the dispatcher; links start on first use.

        Args:
            config: The connector configuration.
            hello: Builds this worker's `Hello` (after registration).
        """
        self.config = config
        self.hello = hello
        self._requests: Codec[Request] = request_codec(config.max_message_bytes)
        self._replies: Codec[Reply] = reply_codec(config.max_message_bytes)
        self._client = RpcClient(timeout_s=config.read_timeout_s, retries=1, max_reply_bytes=config.max_message_bytes)
        self._links: dict[tuple[str, int], _Link] = {}
        self._lock = threading.Lock()
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._voided: OrderedDict[str, None] = OrderedDict()
        self._closed = False
        self.sent = 0

    @property
    def failures_kept(self) -> int:
        """Failures held for `take_failed` (the leak test's counter)."""
        with self._lock:
            return len(self._failed)

    @property
    def voided(self) -> int:
        """Requests failed on P whose last part has not been committed or refused yet."""
        with self._lock:
            return len(self._voided)

    @property
    def links(self) -> int:
        """Endpoint links (one thread each) started so far."""
        with self._lock:
            return len(self._links)

    def call(self, endpoint: tuple[str, int], message: Request, timeout_s: float) -> Reply:
        """One request/reply exchange with a D endpoint (one attempt: a read is never repeated)."""
        body = self._client.request(tcp_endpoint(*endpoint), self._requests.encode(message), timeout_s=timeout_s)
        return self._replies.decode(body)

    def submit(self, part: Part) -> None:
        """Close the part's gates and queue it on its endpoint's link."""
        with self._lock:
            for slot in part.slots:
                slot.pending += 1
                slot.event.clear()
            if self._closed:
                link = None
            else:
                link = self._links.get(part.endpoint)
                if link is None:
                    link = self._links[part.endpoint] = _Link(self, part.endpoint)
                    link.start()
            self.sent += 1
        if link is None:
            self.resolve(part, "worker shut down")
        else:
            link.queue.put(part)

    def resolve(self, part: Part, error: str | None, failed: list[str] | tuple[str, ...] = ()) -> None:
        """Finish a part once: mark failures, release its gates."""
        with self._lock:
            if part.resolved:
                return
            part.resolved = True
            bad = part.ext_ids if error is not None else list(failed)
            self._void(bad, error or "D could not serve it")
            for slot in part.slots:
                slot.pending -= 1
                if error is not None:
                    slot.error = error
                if slot.pending <= 0:
                    slot.pending = 0
                    slot.event.set()
        if error is not None:
            logger.warning(
                "sfa layer %d to %s failed for %d request(s): %s",
                part.message.layer_idx,
                part.endpoint,
                len(part.ext_ids),
                error,
            )

    def _void(self, ext_ids: list[str] | tuple[str, ...], reason: str) -> None:
        """Mark requests failed on P (under the lock): never committed as received."""
        for ext in ext_ids:
            self._failed.setdefault(ext, reason)
            self._voided[ext] = None
            self._voided.move_to_end(ext)
        while len(self._voided) > _VOIDED_MEMORY:
            self._voided.popitem(last=False)
        while len(self._failed) > FAILURES_KEPT:
            self._failed.popitem(last=False)

    def mark_failed(self, ext_ids: list[str], reason: str) -> None:
        """Mark requests failed on P after their commit did not go through."""
        if ext_ids:
            with self._lock:
                self._void(ext_ids, reason)
            logger.warning("sfa: %d request(s) not committed: %s", len(ext_ids), reason)

    def verdict(self, ext_ids: list[str]) -> tuple[list[str], list[str]]:
        """``(counted, failed)`` for requests whose last part was answered; forgets them after."""
        with self._lock:
            failed = [e for e in ext_ids if e in self._voided]
            for ext in failed:
                del self._voided[ext]
            return [e for e in ext_ids if e not in failed], failed

    def take_failed(self) -> dict[str, str]:
        """Requests marked failed on P since the last call (ext id -> reason; the last `FAILURES_KEPT`)."""
        with self._lock:
            out, self._failed = dict(self._failed), OrderedDict()
            return out

    def links_alive(self) -> bool:
        """Whether every started link thread still runs (false after shutdown)."""
        with self._lock:
            return not self._closed and all(link.is_alive() for link in self._links.values())

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every link (after its current exchange), resolve what is queued, join them."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.queue.put(None)
        for link in links:
            link.join(timeout_s)
            while True:  # parts queued behind the stop marker
                try:
                    part = link.queue.get_nowait()
                except queue.Empty:
                    break
                if part is not None:
                    self.resolve(part, "worker shut down")
            if link.is_alive():
                logger.error("sfa link %s did not stop within %.1f s", link.endpoint, timeout_s)
        self._client.close()
