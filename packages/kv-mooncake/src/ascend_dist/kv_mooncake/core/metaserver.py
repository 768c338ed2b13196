"""The one client of the proxy's metaserver: D's scheduler POSTs JSON there, with a deadline.

Runs in: D's scheduler process (layer-wise push and SFA). `HttpMetaserver.post` sends one JSON
payload (stdlib ``urllib``; no pickle) in up to ``attempts`` attempts, each bounded by
``timeout_s``. Two delivery policies run it off the scheduler thread, so the scheduler never blocks
on the network:

* `AsyncAnnouncer` (push): one post per request on a small pool; a post that fails for good fails
  the request through a callback (reported finished, every block invalid).
* `RetryingAnnouncer` (SFA): one background thread; after a failed post the whole post is tried
  again ``retry_s`` later until the request is cancelled (it finished) or the client closes. At
  most one post per request is pending.

TLS (`TlsConfig`, ``kv_connector_extra_config.tls_config``): ``ssl_enable`` requires an
``https://`` URL; ``ssl_ca_certs`` verifies the server (default: the system store);
``ssl_certfile`` / ``ssl_keyfile`` / ``ssl_keyfile_password`` present a client certificate. Host
names are always verified.

With a deployment secret (`ascend_dist.common.secret`), every POST carries a MAC header
(`ascend_dist.common.frame_auth.HTTP_AUTH_HEADER`: timestamp, nonce, HMAC over method, path and
body) that a metaserver holding the secret verifies with `FrameAuth.check_http`; a proxy that does
not know the header ignores it.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, TransferError
from ascend_dist.common.frame_auth import FROM_ENV, HTTP_AUTH_HEADER, FromEnv, resolve_frame_auth
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.kv_mooncake.core.config import bool_field, opt_str_field

__all__ = ["AsyncAnnouncer", "HttpMetaserver", "Metaserver", "RetryingAnnouncer", "TlsConfig", "ssl_context"]

logger = logging.getLogger(__name__)

DELIVERED_MEMORY = 1024  # delivered ids an announcer keeps (it used to keep every one)

_TLS_KEYS = ("ssl_enable", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_keyfile_password")


@dataclass(frozen=True)
class TlsConfig:
    """TLS options of the metaserver client (``kv_connector_extra_config.tls_config``).

    Attributes:
        ssl_enable: Use HTTPS (a plain ``http://`` metaserver URL is refused when on).
        ssl_ca_certs: CA bundle that verifies the metaserver; None = the system store.
        ssl_certfile: Client certificate (mutual TLS), or None.
        ssl_keyfile: Key of the client certificate, or None (then it is inside ``ssl_certfile``).
        ssl_keyfile_password: Password of the key, or None.
    """

    ssl_enable: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_keyfile_password: str | None = None

    @classmethod
    def parse(cls, raw: object) -> TlsConfig:
        """Parse the ``tls_config`` dict (None: TLS off).

        Raises:
            ConfigError: Unknown key or bad type; the field is named ``tls_config.<key>``.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError("tls_config", raw, "a dict of ssl_enable, ssl_ca_certs, ssl_certfile, ssl_keyfile, ...")
        for key in raw:
            if key not in _TLS_KEYS:
                raise ConfigError(f"tls_config.{key}", raw[key], f"one of the keys {sorted(_TLS_KEYS)}")
        keyfile = opt_str_field("tls_config.ssl_keyfile", raw.get("ssl_keyfile"))
        certfile = opt_str_field("tls_config.ssl_certfile", raw.get("ssl_certfile"))
        if keyfile and not certfile:
            raise ConfigError("tls_config.ssl_certfile", None, "a client certificate when ssl_keyfile is set")
        return cls(
            ssl_enable=bool_field("tls_config.ssl_enable", raw.get("ssl_enable", False)),
            ssl_ca_certs=opt_str_field("tls_config.ssl_ca_certs", raw.get("ssl_ca_certs")),
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            ssl_keyfile_password=opt_str_field("tls_config.ssl_keyfile_password", raw.get("ssl_keyfile_password")),
        )


class Metaserver(Protocol):
    """Where D announces a request (the proxy's ``/v1/metaserver``)."""

    def post(self, url: str, payload: Mapping[str, Any]) -> None:
        """Deliver ``payload`` to ``url``; raise `TransferError` / `DeadlineExceeded` on failure."""
        ...


def ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """An SSL context from the TLS options (server verified; client certificate if configured).

    Raises:
        ConfigError: A certificate or key file cannot be loaded; names the ``tls_config`` key.
    """
    try:
        ctx = ssl.create_default_context(cafile=tls.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("tls_config.ssl_ca_certs", tls.ssl_ca_certs, f"a readable PEM CA bundle ({exc})") from exc
    if tls.ssl_certfile:
        try:
            ctx.load_cert_chain(tls.ssl_certfile, tls.ssl_keyfile, tls.ssl_keyfile_password)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                "tls_config.ssl_certfile", tls.ssl_certfile, f"a readable PEM certificate and key ({exc})"
            ) from exc
    return ctx


class HttpMetaserver:
    """`Metaserver` over HTTP or HTTPS (stdlib ``urllib``)."""

    def __init__(
        self,
        tls: TlsConfig | None = None,
        *,
        timeout_s: float = 5.0,
        attempts: int = 3,
        retry_delay_s: float = 0.1,
        answered_is_delivered: bool = False,
        secret: DeploymentSecret | FromEnv | None = FROM_ENV,
    ) -> None:
        """Prepare the client; the SSL context is built once.

        Args:
            tls: TLS options (default: off).
            timeout_s: Deadline of one attempt.
            attempts: Attempts per post.
            retry_delay_s: Pause between attempts.
            answered_is_delivered: An HTTP error status ends the post as delivered (SFA: legacy
                proxies answer 500 for extra prompt-list children) instead of being retried.
            secret: MACs every POST (`HTTP_AUTH_HEADER`); `FROM_ENV` (default) loads it from the
                environment, None sends none.

        Raises:
            ConfigError: Bad TLS files, a bound that is not positive, or an unusable secret.
        """
        if timeout_s <= 0 or attempts < 1 or retry_delay_s < 0:
            raise ConfigError("metaserver client", (timeout_s, attempts, retry_delay_s), "timeout_s > 0, attempts >= 1")
        self._tls = tls or TlsConfig()
        self._timeout_s, self._attempts, self._retry_delay_s = timeout_s, attempts, retry_delay_s
        self._answered_is_delivered = answered_is_delivered
        self._ctx = ssl_context(self._tls) if self._tls.ssl_enable else None
        self._auth = resolve_frame_auth(secret, "metaserver client")

    def post(self, url: str, payload: Mapping[str, Any]) -> None:
        """POST ``payload`` as JSON; any 2xx is success.

        Raises:
            ConfigError: The URL is not http(s), or plain http while ``ssl_enable`` is on.
            TransferError: Every attempt failed (HTTP error status, TLS or connection failure).
            DeadlineExceeded: Every attempt timed out.
        """
        if not url.startswith(("http://", "https://")):
            raise ConfigError("kv_transfer_params.metaserver", url, "an http:// or https:// URL")
        if self._tls.ssl_enable and not url.startswith("https://"):
            raise ConfigError("kv_transfer_params.metaserver", url, "an https:// URL (tls_config.ssl_enable is on)")
        body = json.dumps(dict(payload)).encode()
        reason = ""
        timed_out = True
        for attempt in range(1, self._attempts + 1):
            headers = {"Content-Type": "application/json"}
            if self._auth is not None:  # a fresh nonce per attempt: the metaserver refuses a replay
                parts = urllib.parse.urlsplit(url)
                target = parts.path + ("?" + parts.query if parts.query else "")
                headers[HTTP_AUTH_HEADER] = self._auth.seal_http("POST", target or "/", body)
            req = urllib.request.Request(url, data=body, method="POST", headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=self._timeout_s, context=self._ctx) as resp:
                    resp.read()
                return
            except urllib.error.HTTPError as exc:
                if self._answered_is_delivered:
                    logger.info("metaserver %s answered %d; treated as delivered", url, exc.code)
                    return
                reason, timed_out = f"HTTP {exc.code}", False
            except (TimeoutError, urllib.error.URLError, OSError) as exc:
                inner = getattr(exc, "reason", exc)
                timed_out = isinstance(inner, TimeoutError)
                reason = f"{type(inner).__name__}: {inner}"
            logger.debug("metaserver POST %s attempt %d/%d failed: %s", url, attempt, self._attempts, reason)
            if attempt < self._attempts and self._retry_delay_s:
                time.sleep(self._retry_delay_s)
        if timed_out:
            raise DeadlineExceeded(f"metaserver {url}: no answer in {self._attempts} attempts of {self._timeout_s} s")
        raise TransferError(f"metaserver {url} failed {self._attempts} times: {reason}")


class AsyncAnnouncer:
    """Runs `Metaserver.post` calls on a thread pool; reports failures through a callback."""

    def __init__(self, metaserver: Metaserver, on_failure: Callable[[str, str], None], *, max_workers: int = 4) -> None:
        """Create the pool (threads start on the first post).

        Args:
            metaserver: The client.
            on_failure: Called with ``(request_id, reason)`` when a post fails for good.
            max_workers: Concurrent posts.
        """
        self._metaserver = metaserver
        self._on_failure = on_failure
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="lw-metaserver")
        self._lock = threading.Lock()
        self._closed = False

    def announce(self, request_id: str, url: str, payload: Mapping[str, Any]) -> None:
        """Post in the background."""
        with self._lock:
            if self._closed:
                self._on_failure(request_id, "scheduler shut down")
                return
            self._pool.submit(self._run, request_id, url, dict(payload))

    def _run(self, request_id: str, url: str, payload: dict[str, Any]) -> None:
        try:
            self._metaserver.post(url, payload)
        except Exception as exc:  # any client failure fails this request, never the scheduler
            logger.error("request %s: metaserver announcement failed: %s", request_id, exc)
            self._on_failure(request_id, f"metaserver: {exc}")

    def close(self) -> None:
        """Wait for posts in flight (each bounded by its deadline) and stop the threads. Idempotent."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)


class RetryingAnnouncer:
    """Posts each request's payload until it is delivered, cancelled or the announcer closes.

    A ``ContactSink`` of the SFA scheduler: the URL comes with each request
    (``kv_transfer_params["metaserver"]``).
    """

    def __init__(
        self,
        metaserver: Metaserver | None = None,
        *,
        timeout_s: float = 2.0,
        attempts: int = 3,
        retry_s: float = 1.0,
    ) -> None:
        """Start the posting thread.

        Args:
            metaserver: The client; default plain `HttpMetaserver` with ``timeout_s`` and
                ``attempts``, no pause between attempts, an HTTP error status counting as delivered.
            timeout_s: Deadline of one attempt of the default client.
            attempts: Attempts per post of the default client.
            retry_s: Pause before a failed post is tried again.

        Raises:
            ConfigError: A bound is not positive.
        """
        if retry_s < 0:
            raise ConfigError("metaserver client retry_s", retry_s, "a number >= 0")
        self._client = metaserver or HttpMetaserver(
            timeout_s=timeout_s, attempts=attempts, retry_delay_s=0.0, answered_is_delivered=True
        )
        self._retry_s = retry_s
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, str]] = []
        self._pending: dict[str, tuple[str, dict[str, Any]]] = {}
        self._seq = 0
        self._closed = False
        self.delivered: deque[str] = deque(maxlen=DELIVERED_MEMORY)  # the latest, for logs and tests
        self.delivered_count = 0
        self._thread = threading.Thread(target=self._run, name="sfa-metaserver", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the posting thread is alive."""
        return self._thread.is_alive()

    def post(self, ext_id: str, contact: msgspec.Struct | Mapping[str, Any], url: str | None = None) -> None:
        """Queue the post of ``contact`` (a Struct or a dict) to ``url``; no URL is logged and dropped."""
        if not url:
            logger.warning("request %s has no metaserver URL; P cannot learn where to send", ext_id)
            return
        payload = dict(contact) if isinstance(contact, Mapping) else msgspec.to_builtins(contact)
        with self._cond:
            if self._closed or ext_id in self._pending:
                return
            self._pending[ext_id] = (url, payload)
            self._schedule(ext_id, 0.0)

    def cancel(self, ext_id: str) -> None:
        """Stop retrying a request's post."""
        with self._cond:
            self._pending.pop(ext_id, None)

    def _schedule(self, ext_id: str, delay_s: float) -> None:
        self._seq += 1
        heapq.heappush(self._due, (time.monotonic() + delay_s, self._seq, ext_id))
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cond.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._closed:
                    return
                _, _, ext_id = heapq.heappop(self._due)
                job = self._pending.get(ext_id)
            if job is None:
                continue  # cancelled
            try:
                self._client.post(*job)
                ok = True
            except Exception as exc:  # a failed post is retried, it never kills the thread
                logger.warning("metaserver post for %s failed (retry in %.1f s): %s", ext_id, self._retry_s, exc)
                ok = False
            with self._cond:
                if ext_id not in self._pending:
                    continue
                if ok:
                    del self._pending[ext_id]
                    self.delivered.append(ext_id)
                    self.delivered_count += 1
                elif not self._closed:
                    self._schedule(ext_id, self._retry_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop retrying and join the thread (a post in flight ends within its timeout)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
