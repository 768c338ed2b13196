"""Per-frame MACs on the request/reply side channel: forged, replayed and stale frames are refused.

Runs in: every `ascend_dist.common.zmq_server.RpcServer` and `ascend_dist.common.zmq_rpc.RpcClient`
of a deployment that has a secret (`ascend_dist.common.secret`). The client opens a fresh socket per
attempt and there is no session to bind a handshake to, so each request frame carries its own proof:

* ``auth`` frame of a request: ``timestamp_ns (u64, big-endian) | nonce (16 random bytes) | tag``,
  where ``tag`` is HMAC-SHA256 under the secret's ``"frame"`` subkey over a direction byte, the
  frame header (version, kind, request id), the timestamp, the nonce and the payload.
* The server checks, in this order: the tag (constant time: a stranger learns nothing and fills no
  cache), the timestamp against its wall clock within ``window_s`` either way (clock skew between
  nodes), then the nonce against the nonces it accepted within the window (a bounded cache; when it
  is full the oldest entry is evicted and frames not newer than it are refused as stale, so the
  bound never opens a replay hole).
* A reply carries one more frame: the tag over a direction byte, the reply header, the request's
  nonce and the body, so a reply answers exactly that request and cannot be forged or replayed.

* An HTTP POST (D to the proxy's metaserver) carries the same proof in one header,
  `HTTP_AUTH_HEADER` = ``v1 <timestamp_ns> <nonce> <tag>`` (hex), the tag over the method, the path
  with its query and the body; a metaserver that has the secret checks it with `check_http`.

What this does not do: hide the payload (frames travel in clear, like Mooncake's own transfers), or
stop a captured frame being replayed within the window to *another* server of the same deployment
(the message layer binds request ids and signed capabilities to their owner).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from ascend_dist.common.auth_cost import AUTH_COST
from ascend_dist.common.errors import ConfigError, PeerNotAuthenticated
from ascend_dist.common.secret import TAG_BYTES, DeploymentSecret, load_secret, warn_unauthenticated

__all__ = [
    "AUTH_BYTES",
    "DEFAULT_MAX_NONCES",
    "DEFAULT_WINDOW_S",
    "FRAME_PURPOSE",
    "FROM_ENV",
    "HTTP_AUTH_HEADER",
    "FrameAuth",
    "FromEnv",
    "resolve_frame_auth",
]

FRAME_PURPOSE: Final = "frame"
DEFAULT_WINDOW_S: Final = 30.0
# 64 Ki nonces (~11 MiB when full, measured): ~2,200 requests/s for a whole 30 s window before the
# floor rises (then older in-window frames are refused as stale, never replayed).
DEFAULT_MAX_NONCES: Final = 1 << 16
NONCE_BYTES: Final = 16
_STAMP: Final = struct.Struct("!Q16s")
AUTH_BYTES: Final = _STAMP.size + TAG_BYTES
# Direction bytes: a reply's tag can never pass as a request's and the other way round.
_REQUEST: Final = b"Q"
_REPLY: Final = b"R"
_HTTP: Final = b"H"
HTTP_AUTH_HEADER: Final = "X-Ascend-Dist-Auth"
"""Header of an authenticated HTTP POST (D to the metaserver): ``v1 <timestamp_ns> <nonce> <tag>``, hex."""


class FromEnv:
    """Type of `FROM_ENV`: "read the secret from the environment" (the default everywhere)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "FROM_ENV"


FROM_ENV: Final = FromEnv()


class FrameAuth:
    """Seals and checks frames under one deployment secret; one per server or client. Thread-safe."""

    def __init__(
        self,
        secret: DeploymentSecret,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        max_nonces: int = DEFAULT_MAX_NONCES,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        """Derive the frame subkey and start with an empty replay cache.

        Args:
            secret: The deployment secret every peer shares.
            window_s: How far (either way) a request's timestamp may be from this node's clock.
            max_nonces: Bound of the replay cache.
            clock_ns: Wall clock in nanoseconds (an argument so tests can move time).

        Raises:
            ConfigError: ``window_s`` or ``max_nonces`` is out of range.
        """
        if isinstance(window_s, bool) or not isinstance(window_s, int | float) or not 0 < window_s <= 3600:
            raise ConfigError("window_s", window_s, "seconds in (0, 3600]")
        if isinstance(max_nonces, bool) or not isinstance(max_nonces, int) or max_nonces < 1:
            raise ConfigError("max_nonces", max_nonces, "a positive int")
        # HMAC state after the key is absorbed: copying it saves the key setup on every frame.
        self._base = hmac.new(secret.key_for(FRAME_PURPOSE), digestmod=hashlib.sha256)
        self._window_ns = int(window_s * 1e9)
        self._max_nonces = max_nonces
        self._clock_ns = clock_ns
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> timestamp, oldest accepted first
        self._floor_ns = 0  # frames stamped at or before this were evicted from the cache: refused
        self._lock = threading.Lock()

    def _tag(self, direction: bytes, header: bytes, stamp: bytes, body: bytes | bytearray | memoryview) -> bytes:
        started = AUTH_COST.start()
        mac = self._base.copy()
        mac.update(direction)
        mac.update(header)
        mac.update(stamp)
        mac.update(body)
        tag = mac.digest()
        AUTH_COST.add(started)
        return tag

    def seal_request(self, header: bytes, payload: bytes | bytearray | memoryview) -> bytes:
        """The ``auth`` frame for one request: fresh timestamp and nonce, then the tag."""
        stamp = _STAMP.pack(self._clock_ns(), secrets.token_bytes(NONCE_BYTES))
        return stamp + self._tag(_REQUEST, header, stamp, payload)

    def check_request(
        self, header: bytes, payload: bytes | bytearray | memoryview, auth: bytes, *, direction: bytes = _REQUEST
    ) -> bytes:
        """Verify one request's ``auth`` frame and remember its nonce; returns the nonce.

        Raises:
            PeerNotAuthenticated: ``reason`` is ``"mac"`` (wrong length or tag: another key, or an
                edited frame), ``"stale"`` (timestamp outside the window) or ``"replay"``.
        """
        if len(auth) != AUTH_BYTES:
            raise PeerNotAuthenticated("mac", f"auth frame of {len(auth)} bytes, expected {AUTH_BYTES}")
        stamp, tag = auth[: _STAMP.size], auth[_STAMP.size :]
        if not hmac.compare_digest(self._tag(direction, header, stamp, payload), tag):
            raise PeerNotAuthenticated("mac", "the frame's MAC does not verify under this deployment's secret")
        sent_ns, nonce = _STAMP.unpack(stamp)
        now_ns = self._clock_ns()
        if abs(now_ns - sent_ns) > self._window_ns:
            skew = (now_ns - sent_ns) / 1e9
            raise PeerNotAuthenticated("stale", f"timestamp {skew:+.1f} s from this node's clock")
        with self._lock:
            if sent_ns <= self._floor_ns:
                raise PeerNotAuthenticated("stale", "timestamp older than the replay cache remembers")
            if nonce in self._seen:
                raise PeerNotAuthenticated("replay", "this frame's nonce was already accepted")
            self._expire(now_ns)
            self._seen[nonce] = sent_ns
        return nonce

    def _expire(self, now_ns: int) -> None:
        """Drop nonces the window refuses anyway; evict the oldest (raising the floor) when full."""
        seen = self._seen
        while seen:
            oldest_nonce, oldest_ns = next(iter(seen.items()))
            if now_ns - oldest_ns > self._window_ns:
                del seen[oldest_nonce]
            elif len(seen) >= self._max_nonces:
                del seen[oldest_nonce]
                self._floor_ns = max(self._floor_ns, oldest_ns)
            else:
                return

    @staticmethod
    def nonce_of(auth: bytes) -> bytes:
        """The nonce inside a request's ``auth`` frame (what its reply's tag is bound to)."""
        return auth[8 : _STAMP.size]

    def seal_reply(self, nonce: bytes, header: bytes, body: bytes | bytearray | memoryview) -> bytes:
        """The tag frame of the reply to the request that carried ``nonce``."""
        return self._tag(_REPLY, header, nonce, body)

    def check_reply(self, nonce: bytes, header: bytes, body: bytes | bytearray | memoryview, tag: bytes | None) -> None:
        """Verify a reply's tag against the request's ``nonce``.

        Raises:
            PeerNotAuthenticated: The tag is missing (``"missing"``) or wrong (``"mac"``).
        """
        if tag is None:
            raise PeerNotAuthenticated("missing", "the reply carries no MAC (the server has no secret?)")
        if not hmac.compare_digest(self.seal_reply(nonce, header, body), tag):
            raise PeerNotAuthenticated("mac", "the reply's MAC does not verify under this deployment's secret")

    def seal_http(self, method: str, path: str, body: bytes) -> str:
        """The `HTTP_AUTH_HEADER` value for one request: MAC over method, path (with query) and body."""
        stamp = _STAMP.pack(self._clock_ns(), secrets.token_bytes(NONCE_BYTES))
        tag = self._tag(_HTTP, _http_target(method, path), stamp, body)
        sent_ns, nonce = _STAMP.unpack(stamp)
        return f"v1 {sent_ns:x} {nonce.hex()} {tag.hex()}"

    def check_http(self, method: str, path: str, body: bytes, value: str | None) -> None:
        """Verify an `HTTP_AUTH_HEADER` value as a server (the metaserver) would; same checks as frames.

        Raises:
            PeerNotAuthenticated: Missing or malformed header, wrong MAC, stale or replayed.
        """
        if not value:
            raise PeerNotAuthenticated("missing", f"no {HTTP_AUTH_HEADER} header")
        parts = value.split(" ")
        try:
            if len(parts) != 4 or parts[0] != "v1":
                raise ValueError(parts[0])
            stamp = _STAMP.pack(int(parts[1], 16), bytes.fromhex(parts[2]))
            tag = bytes.fromhex(parts[3])
        except (ValueError, struct.error):
            raise PeerNotAuthenticated("mac", f"malformed {HTTP_AUTH_HEADER} header") from None
        self.check_request(_http_target(method, path), body, stamp + tag, direction=_HTTP)

    @property
    def remembered(self) -> int:
        """Nonces in the replay cache now."""
        with self._lock:
            return len(self._seen)


def _http_target(method: str, path: str) -> bytes:
    # Length-prefixed so that no method/path split can be read as another.
    raw = method.upper().encode() + b" " + path.encode("utf-8", errors="surrogateescape")
    return len(raw).to_bytes(4, "big") + raw


def resolve_frame_auth(secret: DeploymentSecret | FromEnv | None, component: str) -> FrameAuth | None:
    """The `FrameAuth` for a server or client, or None (with the once-per-process warning).

    Args:
        secret: A secret, None for none, or `FROM_ENV` to load it (`load_secret`) from the
            environment every node of the deployment shares.
        component: Names the server or client in the warning.

    Raises:
        ConfigError: The environment names an unusable secret (never silently unauthenticated).
    """
    resolved = load_secret() if isinstance(secret, FromEnv) else secret
    if resolved is None:
        warn_unauthenticated(component)
        return None
    if not isinstance(resolved, DeploymentSecret):
        raise ConfigError("secret", type(resolved).__name__, "a DeploymentSecret, None or FROM_ENV")
    return FrameAuth(resolved)
