"""Bounded request/reply over ZMQ: the client, its socket pool, and re-exports of the server side.

Runs in: any process that asks a peer something (a decode worker fetching KV metadata or sending
DONE, a store client). `RpcClient.request` sends one payload and waits for its reply with a
deadline per attempt and a bounded number of attempts; it never waits forever and never pickles
(payloads are bytes, normally from a `ascend_dist.common.wire.Codec`).

Socket discipline: a socket is taken out of the pool for one exchange
and returned only after a complete exchange. After any failure (deadline, ZMQ error) it is closed
with linger 0 and never reused, and the retry uses a fresh socket. The client uses DEALER
sockets and tags each attempt with a fresh request id (see `ascend_dist.common.zmq_server` for
the frame format), so even a late reply can never be taken as the answer to a newer request.
With a deployment secret each attempt is MAC'ed with its own timestamp and nonce, and a reply is
accepted only with a MAC bound to that nonce (`ascend_dist.common.frame_auth`).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict
from types import TracebackType
from typing import Any

import zmq

from ascend_dist.common.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidTransition,
    MessageTooLarge,
    PeerNotAuthenticated,
    ProtocolError,
)
from ascend_dist.common.frame_auth import FROM_ENV, FrameAuth, FromEnv, resolve_frame_auth
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.wire import DEFAULT_MAX_MESSAGE_BYTES
from ascend_dist.common.zmq_server import (
    KIND_ERROR,
    KIND_REFUSED,
    KIND_REQUEST,
    RpcServer,
    frame_limit,
    pack_header,
    tcp_endpoint,
    unpack_header,
)

__all__ = ["RpcClient", "RpcServer", "SocketPool", "tcp_endpoint"]

logger = logging.getLogger(__name__)


def _positive_int(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(field, value, "a positive int")
    return value


def _seconds(field: str, value: object, *, allow_zero: bool = False) -> float:
    expected = "a finite number of seconds " + (">= 0" if allow_zero else "> 0")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, value, expected)
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not allow_zero):
        raise ConfigError(field, value, expected)
    return seconds


class SocketPool:
    """Idle connected sockets per endpoint: bounded, least-recently-used endpoints evicted first.

    A socket is *taken* for one exchange (so no two threads ever share it) and *put* back only
    after a complete one. The pool closes every socket it refuses or evicts. Thread-safe.
    """

    def __init__(self, *, max_per_endpoint: int = 4, max_endpoints: int = 64) -> None:
        """Create an empty pool.

        Args:
            max_per_endpoint: Idle sockets kept per endpoint; extra returned ones are closed.
            max_endpoints: Endpoints kept; the least recently used one's sockets are closed first.

        Raises:
            ConfigError: A bound is not a positive int.
        """
        self._max_per_endpoint = _positive_int("max_per_endpoint", max_per_endpoint)
        self._max_endpoints = _positive_int("max_endpoints", max_endpoints)
        self._idle: OrderedDict[str, list[zmq.Socket[Any]]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def take(self, endpoint: str) -> zmq.Socket[Any] | None:
        """Remove and return an idle socket connected to ``endpoint``, or None if there is none."""
        with self._lock:
            sockets = self._idle.get(endpoint)
            if not sockets:
                return None
            sock = sockets.pop()
            if not sockets:
                del self._idle[endpoint]
            else:
                self._idle.move_to_end(endpoint)
            return sock

    def put(self, endpoint: str, sock: zmq.Socket[Any]) -> None:
        """Return a socket after a complete exchange; closes it if the pool is full or closed."""
        evicted: list[zmq.Socket[Any]] = []
        with self._lock:
            sockets = self._idle.get(endpoint)
            if self._closed or (sockets is not None and len(sockets) >= self._max_per_endpoint):
                evicted.append(sock)
            else:
                if sockets is None:
                    sockets = self._idle[endpoint] = []
                sockets.append(sock)
                self._idle.move_to_end(endpoint)
                while len(self._idle) > self._max_endpoints:
                    _, old = self._idle.popitem(last=False)
                    evicted.extend(old)
        for old_sock in evicted:
            old_sock.close(linger=0)

    def idle_count(self, endpoint: str | None = None) -> int:
        """Number of idle sockets for ``endpoint``, or in total when None."""
        with self._lock:
            if endpoint is not None:
                return len(self._idle.get(endpoint, ()))
            return sum(len(s) for s in self._idle.values())

    def endpoints(self) -> list[str]:
        """Endpoints with idle sockets, least recently used first."""
        with self._lock:
            return list(self._idle)

    def close(self) -> None:
        """Close every idle socket; sockets put back later are closed at once. Idempotent."""
        with self._lock:
            self._closed = True
            idle = [sock for sockets in self._idle.values() for sock in sockets]
            self._idle.clear()
        for sock in idle:
            sock.close(linger=0)


class _AttemptError(Exception):
    """One attempt got no usable reply in time; the socket was closed."""


class RpcClient:
    """Request/reply client with per-attempt deadlines, bounded retries and a socket pool.

    Safe to share between threads: each request uses its own socket from the pool.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any] | None = None,
        *,
        timeout_s: float = 1.0,
        retries: int = 3,
        retry_delay_s: float = 0.1,
        max_reply_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        pool_size: int = 4,
        max_endpoints: int = 64,
        secret: DeploymentSecret | FromEnv | None = FROM_ENV,
    ) -> None:
        """Create a client; no socket is opened until the first request.

        Args:
            ctx: The ZMQ context; defaults to the process-wide ``zmq.Context.instance()``.
            timeout_s: Default deadline of one attempt (send and reply).
            retries: Total attempts per request (1 = no retry). The worst case for a dead peer
                is ``retries * timeout_s + (retries - 1) * retry_delay_s``.
            retry_delay_s: Pause between attempts.
            max_reply_bytes: Largest reply accepted.
            pool_size: Idle sockets kept per endpoint.
            max_endpoints: Endpoints kept in the pool (least recently used evicted).
            secret: The deployment secret requests are MAC'ed with; `FROM_ENV` (the default)
                loads it from the environment, None sends unauthenticated frames (warned once).

        Raises:
            ConfigError: An argument is out of range, or the environment names an unusable secret.
        """
        self._timeout_s = _seconds("timeout_s", timeout_s)
        self._attempts = _positive_int("retries", retries)
        self._retry_delay_s = _seconds("retry_delay_s", retry_delay_s, allow_zero=True)
        self._max_reply_bytes = _positive_int("max_reply_bytes", max_reply_bytes)
        self._ctx: zmq.Context[Any] = ctx if ctx is not None else zmq.Context.instance()
        self._pool = SocketPool(max_per_endpoint=pool_size, max_endpoints=max_endpoints)
        self._ids = itertools.count(1)
        self._id_lock = threading.Lock()
        self._auth: FrameAuth | None = resolve_frame_auth(secret, "rpc client")

    @property
    def pool(self) -> SocketPool:
        """The client's socket pool (read it to observe reuse; do not put sockets in it)."""
        return self._pool

    def request(self, endpoint: str, payload: bytes, *, timeout_s: float | None = None) -> bytes:
        """Send ``payload`` to ``endpoint`` and return the reply.

        Args:
            endpoint: A ZMQ endpoint, usually from `tcp_endpoint`.
            payload: The encoded request.
            timeout_s: Deadline of each attempt; defaults to the client's ``timeout_s``.

        Returns:
            The reply body.

        Raises:
            DeadlineExceeded: No attempt got a reply in time; names the endpoint and attempts.
            PeerNotAuthenticated: The server refused the request's MAC (or has no secret while
                this client has one), or its reply's MAC failed (not retried).
            ProtocolError: The server's handler failed and sent an error frame (not retried).
            MessageTooLarge: The reply exceeds ``max_reply_bytes`` (not retried).
            ConfigError: Bad ``endpoint``, ``payload`` or ``timeout_s``.
            InvalidTransition: The client was closed.
        """
        if self._pool.closed:
            raise InvalidTransition("RpcClient", "closed", "request")
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise ConfigError("payload", type(payload).__name__, "bytes (encode messages with a Codec)")
        attempt_s = self._timeout_s if timeout_s is None else _seconds("timeout_s", timeout_s)
        reason = ""
        for attempt in range(1, self._attempts + 1):
            try:
                kind, body = self._attempt(endpoint, payload, attempt_s)
            except (_AttemptError, zmq.ZMQError) as exc:
                reason = str(exc)
                logger.debug("attempt %d/%d to %s failed: %s", attempt, self._attempts, endpoint, reason)
                if attempt < self._attempts:
                    time.sleep(self._retry_delay_s)
                continue
            if kind == KIND_ERROR:
                text = bytes(body[:1024]).decode("utf-8", errors="replace")
                raise ProtocolError(f"{endpoint} failed to handle the request: {text}")
            if kind == KIND_REFUSED:
                reason, _, detail = bytes(body[:1024]).decode("utf-8", errors="replace").partition(": ")
                raise PeerNotAuthenticated(reason[:32], f"{endpoint} refused the request: {detail}")
            if len(body) > self._max_reply_bytes:
                max_reply_bytes = self._max_reply_bytes
                size = len(body)
                raise MessageTooLarge(f"reply of {size} bytes from {endpoint} exceeds {max_reply_bytes=}")
            return body
        raise DeadlineExceeded(
            f"no reply from {endpoint} after {self._attempts} attempt(s) of {attempt_s}s each: {reason}"
        )

    def close(self) -> None:
        """Close the idle sockets (linger 0); requests in flight close theirs when done. Idempotent."""
        self._pool.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _next_id(self) -> int:
        with self._id_lock:
            return next(self._ids)

    def _connect(self, endpoint: str) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, frame_limit(self._max_reply_bytes))
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError("endpoint", endpoint, f"a ZMQ endpoint such as 'tcp://127.0.0.1:5555' ({exc})") from exc
        return sock

    def _attempt(self, endpoint: str, payload: bytes, timeout_s: float) -> tuple[int, bytes]:
        """One exchange on one socket; the socket goes back to the pool only if it completed."""
        deadline = time.monotonic() + timeout_s
        sock = self._pool.take(endpoint)
        if sock is None:
            sock = self._connect(endpoint)
        request_id = self._next_id()
        header = pack_header(KIND_REQUEST, request_id)
        frames: list[Any] = [b"", header, payload]
        if self._auth is not None:
            frames.append(self._auth.seal_request(header, payload))
        completed = False
        try:
            self._send(sock, frames, deadline)
            kind, reply_header, body, tag = self._receive(sock, request_id, deadline)
            if self._auth is not None and kind != KIND_REFUSED:
                self._auth.check_reply(FrameAuth.nonce_of(frames[3]), reply_header, body, tag)
            completed = True
            return kind, body
        finally:
            if completed:
                self._pool.put(endpoint, sock)
            else:
                # A socket that missed its reply is never reused (its reply may still arrive).
                sock.close(linger=0)

    @staticmethod
    def _send(sock: zmq.Socket[Any], frames: list[Any], deadline: float) -> None:
        while True:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _AttemptError("send queue full until the deadline")
            sock.poll(max(1, int(remaining * 1000)), zmq.POLLOUT)

    @staticmethod
    def _receive(sock: zmq.Socket[Any], request_id: int, deadline: float) -> tuple[int, bytes, bytes, bytes | None]:
        """The reply to ``request_id``: ``(kind, header, body, MAC frame or None)``."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                raise _AttemptError("no reply before the deadline")
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            header = unpack_header(frames[1]) if len(frames) in (3, 4) and frames[0] == b"" else None
            if header is None or header[0] == KIND_REQUEST:
                logger.warning("dropped a malformed reply (%d frames)", len(frames))
                continue
            kind, reply_id = header
            if reply_id != request_id:
                # A late reply to an earlier exchange: never the answer to this one.
                logger.debug("dropped a stale reply: id %d, waiting for %d", reply_id, request_id)
                continue
            return kind, frames[1], frames[2], frames[3] if len(frames) == 4 else None
