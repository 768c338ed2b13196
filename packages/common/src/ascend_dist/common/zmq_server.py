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

Anything else (wrong frame count, non-empty delimiter, unknown version or kind, a payload over
``max_bytes``) is logged and dropped; the server keeps serving. A change to this format bumps
`FRAME_VERSION`.
"""

from __future__ import annotations

import errno
import logging
import struct
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

import zmq

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, InvalidTransition
from ascend_dist.common.wire import DEFAULT_MAX_MESSAGE_BYTES

__all__ = [
    "FRAME_VERSION",
    "KIND_ERROR",
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
_KINDS: Final = frozenset({KIND_REQUEST, KIND_REPLY, KIND_ERROR})
_HEADER: Final = struct.Struct("!BBQ")
_REQUEST_ID_MASK: Final = (1 << 64) - 1
# Error replies carry the exception type and a clipped message, never a traceback.
_MAX_ERROR_TEXT: Final = 512
# ZMTP's READY command (socket type, identity metadata) must fit under ZMQ_MAXMSGSIZE too.
_ZMTP_SLACK: Final = 64 * 1024
_WILDCARD_HOSTS: Final = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


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

    The handler is called with each request payload, one at a time, on the server thread; it
    returns the reply bytes, or None to send no reply (the client then times out). If it raises,
    the exception is logged with its type and an error frame is sent, which the client turns into
    `ProtocolError` without retrying; the server keeps serving. A slow handler delays every
    other request, so handlers should only decode, enqueue and reply.

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
    ) -> None:
        """Validate the arguments and bind the ROUTER socket.

        Args:
            host: The interface to bind (never a wildcard unless ``allow_wildcard``).
            port: The port; 0 lets the OS choose (read it back from `port`).
            handler: Called with each request payload; returns the reply or None. Required.
            ctx: The ZMQ context; defaults to the process-wide ``zmq.Context.instance()``.
            max_bytes: Largest request payload handled (and reply sent); larger ones are dropped.
            poll_interval_s: How often the server thread checks for `stop`.
            name: Label used in log messages and the thread name.
            allow_wildcard: Permit binding to all interfaces.

        Raises:
            ConfigError: An argument is invalid, the port is in use, or the host is not a local
                interface.
        """
        if handler is None or not callable(handler):
            raise ConfigError("handler", handler, "a callable taking bytes and returning bytes or None")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ConfigError("max_bytes", max_bytes, "a positive int")
        if not isinstance(poll_interval_s, int | float) or not 0 < poll_interval_s <= 10:
            raise ConfigError("poll_interval_s", poll_interval_s, "a number of seconds in (0, 10]")
        endpoint = tcp_endpoint(host, port, allow_wildcard=allow_wildcard)
        self._handler = handler
        self._max_bytes = max_bytes
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        self._name = name
        self._state = "new"
        self._endpoint = endpoint  # the requested one until ZMQ reports the bound one
        self._ctx: zmq.Context[Any] = ctx if ctx is not None else zmq.Context.instance()
        self._sock = self._bind(endpoint, host, port)
        self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(self._endpoint.rsplit(":", 1)[1])
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        logger.info("%s server bound to %s", name, self._endpoint)

    def _bind(self, endpoint: str, host: str, port: int) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, frame_limit(self._max_bytes))
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
        """Whether the server thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the server thread.

        Raises:
            InvalidTransition: The server was already started or stopped.
        """
        with self._lock:
            if self._state != "new":
                raise InvalidTransition(f"RpcServer {self._name}", self._state, "running")
            self._state = "running"
            self._thread = threading.Thread(target=self._serve, name=f"{self._name}-server:{self._port}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving, join the thread and close the socket. Idempotent.

        Args:
            timeout_s: How long to wait for the thread (a handler still running delays it).

        Raises:
            DeadlineExceeded: The thread did not finish within ``timeout_s``; call `stop` again.
        """
        with self._lock:
            previous, self._state = self._state, "stopped"
            thread = self._thread
        self._stop_event.set()
        if previous == "new":
            # Never started: the socket was never handed to a thread, close it here.
            self._sock.close(linger=0)
            logger.info("%s server on %s closed (never started)", self._name, self._endpoint)
            return
        if thread is None:
            return
        thread.join(timeout_s)
        if thread.is_alive():
            raise DeadlineExceeded(f"{self._name} server thread on {self._endpoint} did not stop within {timeout_s}s")
        if previous == "running":
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
        """Thread body: poll, handle one message, repeat until stopped; owns the socket."""
        sock = self._sock
        try:
            while not self._stop_event.is_set():
                if not sock.poll(self._poll_ms, zmq.POLLIN):
                    continue
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self._handle(sock, frames)
        except zmq.ZMQError as exc:
            # Typically the context was terminated under us; nothing more can be served.
            logger.error("%s server on %s stopped by ZMQ error: %s", self._name, self._endpoint, exc)
        finally:
            sock.close(linger=0)

    def _handle(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        """Validate one received message, run the handler and send its reply."""
        if len(frames) != 4 or frames[1] != b"":
            logger.warning(
                "%s server dropped a malformed request of %d frames (expected 4)",
                self._name,
                len(frames),
            )
            return
        identity, _, header, payload = frames
        parsed = unpack_header(header)
        if parsed is None or parsed[0] != KIND_REQUEST:
            logger.warning(
                "%s server dropped a request with a bad header (%d bytes, version %d expected)",
                self._name,
                len(header),
                FRAME_VERSION,
            )
            return
        if len(payload) > self._max_bytes:
            logger.warning(
                "%s server dropped a %d-byte request: over max_bytes=%d",
                self._name,
                len(payload),
                self._max_bytes,
            )
            return
        reply = self._call(payload)
        if reply is None:
            return
        kind, body = reply
        try:
            sock.send_multipart([identity, b"", pack_header(kind, parsed[1]), body], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # ROUTER drops replies to vanished peers silently; anything else is worth a warning.
            logger.warning("%s server could not send a reply: %s", self._name, exc)

    def _call(self, payload: bytes) -> tuple[int, bytes | bytearray | memoryview] | None:
        """Run the handler; turn its result or exception into ``(kind, body)`` or None."""
        try:
            result = self._handler(payload)
        except Exception as exc:
            logger.exception(
                "%s server handler raised %s; replying with an error frame", self._name, type(exc).__name__
            )
            text = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_TEXT]
            return KIND_ERROR, text.encode("utf-8", errors="replace")
        if result is None:
            return None
        if not _is_bytes_like(result):
            logger.error("%s server handler returned %s instead of bytes", self._name, type(result).__name__)
            return KIND_ERROR, f"handler returned {type(result).__name__}, not bytes".encode()
        size = memoryview(result).nbytes
        if size > self._max_bytes:
            logger.error("%s server handler returned %d bytes, over max_bytes=%d", self._name, size, self._max_bytes)
            return KIND_ERROR, f"reply of {size} bytes exceeds max_bytes={self._max_bytes}".encode()
        return KIND_REPLY, result
