"""The ROUTER side of the request/reply side channel, and the frame format it shares with the client.

Runs in: any process that answers peers (a prefill worker serving KV metadata and DONE
notifications, a store server). `RpcServer` owns one ROUTER socket bound to one explicit
interface and one thread that serves it; payloads are opaque bytes, normally produced and read
by a `ascend_dist.common.wire.Codec`. `ascend_dist.common.zmq_rpc` holds the client.

Frame format, version 1 (every frame list below is one ZMQ multipart message):

* request, client DEALER -> server ROUTER: ``[b"", header, payload]``; the ROUTER sees
  ``[identity, b"", header, payload]``.
* reply, server -> client: ``[b"", header, body]``.
* ``header`` is 10 bytes, big-endian ``(version: u8, kind: u8, request_id: u64)``. Kinds: 0 =
  request, 1 = reply (``body`` is the handler's bytes), 2 = error (``body`` is UTF-8 text naming
  the exception the handler raised; the client raises `ProtocolError` with it).
* The client draws a fresh ``request_id`` for every attempt and ignores replies carrying another
  id, so a late reply to an abandoned attempt can never answer a newer request.
* With a deployment secret (`ascend_dist.common.frame_auth`), a request carries one more frame,
  ``auth`` (timestamp, nonce, MAC), and a reply one more, its MAC bound to the request's nonce.
  The server checks ``auth`` on the socket thread, before the request is queued, and answers a
  request that fails (no ``auth``, wrong MAC, stale, replayed; or an ``auth`` frame to a server
  without a secret) with kind 3 = refused: ``body`` is ``reason: detail`` in UTF-8, the client
  raises `PeerNotAuthenticated`. The frame is optional, so peers without a secret speak version 1
  exactly as before; a mismatch in configuration is refused, never half-served.

Anything else (wrong frame count, non-empty delimiter, unknown version or kind, a payload over
``max_bytes``) is dropped; the server keeps serving. A change to this format bumps `FRAME_VERSION`.

Bounded by construction: a socket thread drains the ROUTER at once into a `FrameQueue` bounded in
bytes (requests that do not fit are dropped, never buffered), and a handler thread answers from it,
small requests first, so a flood of large frames neither grows the process nor delays the small
requests behind it. Every kind of dropped frame or handler error is logged at most once per
interval, with a count (`IntervalLog`); a `ProtocolError` carrying a ``reply`` (a codec's refusal)
is answered with that reply instead of an error frame.
"""

from __future__ import annotations

import errno
import itertools
import logging
import struct
import threading
import time
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import Any, Final

import zmq

from ascend_dist.common.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidTransition,
    PeerNotAuthenticated,
    ProtocolError,
)
from ascend_dist.common.frame_auth import FROM_ENV, FrameAuth, FromEnv, resolve_frame_auth
from ascend_dist.common.frame_queue import FrameQueue
from ascend_dist.common.log import IntervalLog
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.wire import DEFAULT_MAX_MESSAGE_BYTES

__all__ = [
    "FRAME_VERSION",
    "KIND_ERROR",
    "KIND_REFUSED",
    "KIND_REPLY",
    "KIND_REQUEST",
    "RpcServer",
    "frame_limit",
    "pack_header",
    "tcp_endpoint",
    "unpack_header",
]

logger = logging.getLogger(__name__)

Handler = Callable[[bytes], bytes | bytearray | memoryview | None]

FRAME_VERSION: Final = 1
KIND_REQUEST: Final = 0
KIND_REPLY: Final = 1
KIND_ERROR: Final = 2
KIND_REFUSED: Final = 3
_KINDS: Final = frozenset({KIND_REQUEST, KIND_REPLY, KIND_ERROR, KIND_REFUSED})
_HEADER: Final = struct.Struct("!BBQ")
_REQUEST_ID_MASK: Final = (1 << 64) - 1
# Error replies carry the exception type and a clipped message, never a traceback.
_MAX_ERROR_TEXT: Final = 512
# ZMTP's READY command (socket type, identity metadata) must fit under ZMQ_MAXMSGSIZE too.
_ZMTP_SLACK: Final = 64 * 1024
_WILDCARD_HOSTS: Final = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
# Requests up to this size use the small lane of the receive queue (see `FrameQueue`).
SMALL_REQUEST_BYTES: Final = 64 * 1024
_SMALL_LANE_BUDGET: Final = 8 * 1024 * 1024
# Per ROUTER pipe, in messages: the socket thread drains it at once, so this only caps a burst.
_RCVHWM: Final = 64
_wake_ids = itertools.count()


def tcp_endpoint(host: str, port: int, *, allow_wildcard: bool = False) -> str:
    """Build a ``tcp://`` endpoint for one explicit interface.

    Args:
        host: An IPv4/IPv6 address or host name. IPv6 addresses are bracketed.
        port: 0 to 65535 (0 lets the OS pick when binding).
        allow_wildcard: Accept ``""``, ``"*"``, ``"0.0.0.0"`` or ``"::"`` (all interfaces).
            Off by default: listening sockets bind to the configured host only.

    Returns:
        For example ``"tcp://127.0.0.1:5555"`` or ``"tcp://[::1]:5555"``.

    Raises:
        ConfigError: ``host`` is a wildcard without ``allow_wildcard``, or is not a str;
            ``port`` is out of range.
    """
    if not isinstance(host, str) or any(ch.isspace() for ch in host):
        raise ConfigError("host", host, "an IP address or host name without spaces")
    if host in _WILDCARD_HOSTS and not allow_wildcard:
        raise ConfigError("host", host, "a specific interface such as '127.0.0.1' (wildcards need allow_wildcard=True)")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError("port", port, "an int in [0, 65535]")
    if host == "":
        host = "*"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def pack_header(kind: int, request_id: int) -> bytes:
    """Encode a version-1 frame header.

    Args:
        kind: `KIND_REQUEST`, `KIND_REPLY` or `KIND_ERROR`.
        request_id: The exchange's id; reduced modulo 2**64.

    Returns:
        The 10-byte header.
    """
    return _HEADER.pack(FRAME_VERSION, kind, request_id & _REQUEST_ID_MASK)


def unpack_header(frame: bytes) -> tuple[int, int] | None:
    """Decode a frame header.

    Args:
        frame: The header frame as received.

    Returns:
        ``(kind, request_id)``, or None when the frame is not a version-1 header of a known kind.
    """
    if len(frame) != _HEADER.size:
        return None
    version, kind, request_id = _HEADER.unpack(frame)
    if version != FRAME_VERSION or kind not in _KINDS:
        return None
    return kind, request_id


def frame_limit(max_bytes: int) -> int:
    """The ZMQ_MAXMSGSIZE set on a socket whose payloads are bounded by ``max_bytes``.

    Twice the bound plus room for ZMTP's own handshake commands (which the option also limits):
    payloads a little over the bound still arrive and are logged and dropped by our own check,
    while a grossly oversized frame makes ZMQ drop the connection before buffering it.
    """
    return 2 * max_bytes + _ZMTP_SLACK


def _is_bytes_like(value: object) -> bool:
    return isinstance(value, bytes | bytearray | memoryview)


class RpcServer:
    """A ROUTER socket on one interface, answered by a handler on one thread.

    The handler is called with each request payload, one at a time, on the handler thread; it
    returns the reply bytes, or None to send no reply (the client then times out). If it raises,
    an error frame is sent, which the client turns into `ProtocolError` without retrying (a
    `ProtocolError` with a ``reply`` is answered with that reply); the server keeps serving.
    Handlers should only decode, enqueue and reply: a slow one delays the requests behind it.

    Requests wait in a `FrameQueue` of at most ``queue_bytes`` (plus a small lane of 8 MiB for
    requests up to `SMALL_REQUEST_BYTES`); a request that does not fit is dropped.

    The socket is bound in the constructor (so `port` is known at once) and closed by `stop`.
    Use it as a context manager, or call `start` and `stop`.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        handler: Handler | None = None,
        *,
        ctx: zmq.Context[Any] | None = None,
        max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        poll_interval_s: float = 0.1,
        name: str = "rpc",
        allow_wildcard: bool = False,
        queue_bytes: int | None = None,
        log_interval_s: float = 10.0,
        secret: DeploymentSecret | FromEnv | None = FROM_ENV,
        inline: Callable[[bytes], bool] | None = None,
    ) -> None:
        """Validate the arguments and bind the ROUTER socket.

        Args:
            host: The interface to bind (never a wildcard unless ``allow_wildcard``).
            port: The port; 0 lets the OS choose (read it back from `port`).
            handler: Called with each request payload; returns the reply or None. Required.
            ctx: The ZMQ context; defaults to the process-wide ``zmq.Context.instance()``.
            max_bytes: Largest request payload handled (and reply sent); larger ones are dropped.
            poll_interval_s: How often the server threads check for `stop`.
            name: Label used in log messages and the thread names.
            allow_wildcard: Permit binding to all interfaces.
            queue_bytes: Bytes of large requests that may wait for the handler (default
                ``2 * max_bytes``, at least 1 MiB); at least ``max_bytes``.
            log_interval_s: Each kind of dropped frame or handler error is logged once per this.
            secret: The deployment secret every request must be MAC'ed with; `FROM_ENV` (the
                default) loads it from the environment, None serves unauthenticated (warned once).
            inline: Says, from a request's payload, whether the handler may answer it on the
                socket thread at once instead of queueing it for the handler thread: two thread
                hand-offs fewer per request, each of which waits for the GIL while another thread
                runs Python. Only for requests whose handling is short and never blocks (a lock
                held for microseconds, a small reply): while it runs no other request is read.

        Raises:
            ConfigError: An argument is invalid, the port is in use, the host is not a local
                interface, or the environment names an unusable secret.
        """
        if handler is None or not callable(handler):
            raise ConfigError("handler", handler, "a callable taking bytes and returning bytes or None")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError("max_bytes", max_bytes, "a positive int")
        if not isinstance(poll_interval_s, int | float) or not 0 < poll_interval_s <= 10:
            raise ConfigError("poll_interval_s", poll_interval_s, "a number of seconds in (0, 10]")
        bulk = max(2 * max_bytes, 1 << 20) if queue_bytes is None else queue_bytes
        if isinstance(bulk, bool) or not isinstance(bulk, int) or bulk < max_bytes:
            raise ConfigError("queue_bytes", queue_bytes, f"an int >= max_bytes ({max_bytes})")
        endpoint = tcp_endpoint(host, port, allow_wildcard=allow_wildcard)
        self._auth: FrameAuth | None = resolve_frame_auth(secret, f"{name} server")
        self._refused_auth = 0
        self._handler = handler
        self._inline = inline
        self._max_bytes = max_bytes
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        self._name = name
        self._state = "new"
        self._limiter = IntervalLog(log_interval_s)
        self._queue: FrameQueue[tuple[bytes, int, bytes, bytes]] = FrameQueue(
            small_budget=_SMALL_LANE_BUDGET, bulk_budget=bulk, small_bytes=SMALL_REQUEST_BYTES
        )
        self._endpoint = endpoint  # the requested one until ZMQ reports the bound one
        self._ctx: zmq.Context[Any] = ctx if ctx is not None else zmq.Context.instance()
        self._sock = self._bind(endpoint, host, port)
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(self._endpoint.rsplit(":", 1)[1])
        # Replies travel from the handler thread to the socket thread (the only one that may use
        # the ROUTER) over an inproc pair, which also wakes the socket thread's poll.
        wake = f"inproc://ascend-dist-rpc-wake-{next(_wake_ids)}"
        self._replies_in = self._ctx.socket(zmq.PAIR)
        self._replies_in.setsockopt(zmq.LINGER, 0)
        self._replies_in.bind(wake)
        self._replies_out = self._ctx.socket(zmq.PAIR)
        self._replies_out.setsockopt(zmq.LINGER, 0)
        self._replies_out.setsockopt(zmq.SNDTIMEO, 1000)  # a burst of replies waits, never blocks forever
        self._replies_out.connect(wake)
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        logger.info("%s server bound to %s", name, self._endpoint)

    def _bind(self, endpoint: str, host: str, port: int) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, frame_limit(self._max_bytes))
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError("port", port, f"a free port on {host} ({exc})") from exc
            raise ConfigError("host", host, f"an address of a local interface ({exc})") from exc
        return sock

    @property
    def port(self) -> int:
        """The bound port (the OS-assigned one when constructed with port 0)."""
        return self._port

    @property
    def endpoint(self) -> str:
        """The bound endpoint as ZMQ reports it, such as ``"tcp://127.0.0.1:40123"``."""
        return self._endpoint

    @property
    def name(self) -> str:
        """The label used in log messages."""
        return self._name

    @property
    def running(self) -> bool:
        """Whether the server threads are alive."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    @property
    def queued_bytes(self) -> int:
        """Bytes of requests waiting for the handler now."""
        return self._queue.queued_bytes

    @property
    def authenticated(self) -> bool:
        """Whether requests must carry a valid MAC (a deployment secret is configured)."""
        return self._auth is not None

    @property
    def refused_unauthenticated(self) -> int:
        """Requests refused since start because their ``auth`` frame failed (or was missing)."""
        return self._refused_auth

    @property
    def dropped_for_space(self) -> int:
        """Requests dropped since start because the receive queue's budget was spent."""
        return self._queue.refused

    def start(self) -> None:
        """Start the socket and handler threads.

        Raises:
            InvalidTransition: The server was already started or stopped.
        """
        with self._lock:
            if self._state != "new":
                raise InvalidTransition(f"RpcServer {self._name}", self._state, "running")
            self._state = "running"
            self._threads = [
                threading.Thread(target=self._serve, name=f"{self._name}-server:{self._port}", daemon=True),
                threading.Thread(target=self._work, name=f"{self._name}-handler:{self._port}", daemon=True),
            ]
            for thread in self._threads:
                thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, join the threads and close the sockets. Idempotent.

        Args:
            timeout_s: How long to wait for the threads (a handler still running delays it).

        Raises:
            DeadlineExceeded: A thread did not finish within ``timeout_s``; call `stop` again.
        """
        with self._lock:
            previous, self._state = self._state, "stopped"
            threads = list(self._threads)
        self._stop_event.set()
        if previous == "new":
            # Never started: the sockets were never handed to a thread, close them here.
            for sock in (self._sock, self._replies_in, self._replies_out):
                sock.close(linger=0)
            logger.info("%s server on %s closed (never started)", self._name, self._endpoint)
            return
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise DeadlineExceeded(
                    f"{self._name} server thread {thread.name} on {self._endpoint} did not stop within {timeout_s}s"
                )
        if previous == "running":
            self._queue.clear()
            logger.info("%s server on %s stopped", self._name, self._endpoint)

    def __enter__(self) -> RpcServer:
        if self._state == "new":
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RpcServer(name={self._name!r}, endpoint={self._endpoint!r}, state={self._state})"

    def _serve(self) -> None:
        """Socket thread: queue requests, forward replies, until stopped; owns the ROUTER."""
        sock, replies = self._sock, self._replies_in
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        try:
            while not self._stop_event.is_set():
                ready = dict(poller.poll(self._poll_ms))
                if replies in ready:
                    self._forward_replies(sock, replies)
                if sock in ready:
                    self._drain(sock)
        except zmq.ZMQError as exc:
            # Typically the context was terminated under us; nothing more can be served.
            logger.error("%s server on %s stopped by ZMQ error: %s", self._name, self._endpoint, exc)
        finally:
            sock.close(linger=0)
            replies.close(linger=0)

    def _drain(self, sock: zmq.Socket[Any]) -> None:
        """Move every request waiting on the socket into the queue (or drop it)."""
        for _ in range(1024):  # then forward replies again: neither direction starves
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            request = self._admit(sock, frames)
            if request is None:
                continue
            if self._inline is not None and self._answer_inline(sock, request):
                continue
            if not self._queue.put(request, len(request[2])):
                self._drop("queue-full", "dropped a %d-byte request: receive queue full", len(request[2]))

    def _answer_inline(self, sock: zmq.Socket[Any], request: tuple[bytes, int, bytes, bytes]) -> bool:
        """Answer ``request`` here when `inline` says so (socket thread: it owns the ROUTER)."""
        identity, request_id, payload, nonce = request
        try:
            here = self._inline is not None and self._inline(payload)
        except Exception:  # a predicate that cannot tell: let the handler thread answer (and report)
            here = False
        if not here:
            return False
        reply = self._call(payload)
        if reply is not None:
            try:
                sock.send_multipart(self._reply_frames(identity, request_id, nonce, reply), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self._drop("send", "could not send a reply: %s", exc)
        return True

    def _reply_frames(
        self, identity: bytes, request_id: int, nonce: bytes, reply: tuple[int, bytes | bytearray | memoryview]
    ) -> list[Any]:
        kind, body = reply
        header = pack_header(kind, request_id)
        frames: list[Any] = [identity, b"", header, body]
        if self._auth is not None:
            frames.append(self._auth.seal_reply(nonce, header, body))
        return frames

    def _forward_replies(self, sock: zmq.Socket[Any], replies: zmq.Socket[Any]) -> None:
        while True:
            try:
                frames = replies.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                # ROUTER drops replies to vanished peers silently; anything else is worth a warning.
                self._drop("send", "could not send a reply: %s", exc)

    def _drop(self, kind: Hashable, msg: str, *args: object) -> None:
        self._limiter.log(logger, logging.WARNING, kind, "%s server " + msg, self._name, *args)

    def _admit(self, sock: zmq.Socket[Any], frames: list[bytes]) -> tuple[bytes, int, bytes, bytes] | None:
        """Check one message's framing and MAC: ``(identity, request_id, payload, nonce)`` or None."""
        if len(frames) not in (4, 5) or frames[1] != b"":
            self._drop("frames", "dropped a malformed request of %d frames (expected 4 or 5)", len(frames))
            return None
        identity, _, header, payload = frames[:4]
        auth = frames[4] if len(frames) == 5 else None
        parsed = unpack_header(header)
        if parsed is None or parsed[0] != KIND_REQUEST:
            self._drop(
                "header",
                "dropped a request with a bad header (%d bytes, version %d expected)",
                len(header),
                FRAME_VERSION,
            )
            return None
        if len(payload) > self._max_bytes:
            self._drop("size", "dropped a %d-byte request: over max_bytes=%d", len(payload), self._max_bytes)
            return None
        try:
            nonce = self._authenticate(header, payload, auth)
        except PeerNotAuthenticated as exc:
            self._refuse(sock, identity, parsed[1], exc)
            return None
        return identity, parsed[1], payload, nonce

    def _authenticate(self, header: bytes, payload: bytes, auth: bytes | None) -> bytes:
        """The request's nonce (empty without a secret); raises `PeerNotAuthenticated`."""
        if self._auth is None:
            if auth is not None:
                raise PeerNotAuthenticated("unexpected", "this server has no deployment secret; the client has one")
            return b""
        if auth is None:
            raise PeerNotAuthenticated("missing", "this server requires a MAC on every frame (deployment secret)")
        return self._auth.check_request(header, payload, auth)

    def _refuse(self, sock: zmq.Socket[Any], identity: bytes, request_id: int, exc: PeerNotAuthenticated) -> None:
        """Answer a request that failed authentication (socket thread: it owns the ROUTER)."""
        self._refused_auth += 1
        self._drop(("auth", exc.reason), "refused a request: %s", exc)
        body = f"{exc.reason}: {exc}"[:_MAX_ERROR_TEXT].encode("utf-8", errors="replace")
        try:
            sock.send_multipart([identity, b"", pack_header(KIND_REFUSED, request_id), body], zmq.NOBLOCK)
        except zmq.ZMQError as send_exc:
            self._drop("send", "could not send a refusal: %s", send_exc)

    def _work(self) -> None:
        """Handler thread: answer queued requests in order until stopped."""
        out = self._replies_out
        try:
            while not self._stop_event.is_set():
                request = self._queue.get(self._poll_ms / 1000)
                if request is None:
                    continue
                identity, request_id, payload, nonce = request
                reply = self._call(payload)
                if reply is None:
                    continue
                try:
                    out.send_multipart(self._reply_frames(identity, request_id, nonce, reply))
                except zmq.ZMQError as exc:
                    if not self._stop_event.is_set():  # at stop the socket thread is gone: expected
                        self._drop("send", "could not pass a reply to the socket thread: %s", exc)
        finally:
            out.close(linger=0)

    def _call(self, payload: bytes) -> tuple[int, bytes | bytearray | memoryview] | None:
        """Run the handler; turn its result or exception into ``(kind, body)`` or None."""
        try:
            result = self._handler(payload)
        except ProtocolError as exc:
            # Hostile or foreign input: expected, so no traceback; a codec's refusal is the answer.
            answer = "its refusal" if exc.reply is not None else "an error frame"
            self._limiter.log(
                logger,
                logging.WARNING,
                ("protocol", type(exc).__name__),
                "%s server refused a request (%s: %s); answering with %s",
                self._name,
                type(exc).__name__,
                str(exc)[:_MAX_ERROR_TEXT],
                answer,
            )
            if exc.reply is not None:
                return self._checked_reply(exc.reply)
            return KIND_ERROR, f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT].encode("utf-8", errors="replace")
        except Exception as exc:
            self._limiter.log(
                logger,
                logging.ERROR,
                ("handler", type(exc).__name__),
                "%s server handler raised %s; replying with an error frame",
                self._name,
                type(exc).__name__,
                exc_info=exc,
            )
            text = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT]
            return KIND_ERROR, text.encode("utf-8", errors="replace")
        if result is None:
            return None
        return self._checked_reply(result)

    def _checked_reply(self, result: object) -> tuple[int, bytes | bytearray | memoryview]:
        if not _is_bytes_like(result):
            logger.error("%s server handler returned %s instead of bytes", self._name, type(result).__name__)
            return KIND_ERROR, f"handler returned {type(result).__name__}, not bytes".encode()
        assert isinstance(result, bytes | bytearray | memoryview)
        size = memoryview(result).nbytes
        if size > self._max_bytes:
            logger.error("%s server handler returned %d bytes, over max_bytes=%d", self._name, size, self._max_bytes)
            return KIND_ERROR, f"reply of {size} bytes exceeds max_bytes={self._max_bytes}".encode()
        return KIND_REPLY, result
