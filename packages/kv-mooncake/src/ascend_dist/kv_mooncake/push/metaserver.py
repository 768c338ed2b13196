"""D's scheduler announces its blocks to the proxy's metaserver over HTTP(S), with a deadline.

Runs in: the D scheduler process. `HttpMetaserver.post` sends D's `PushParams` as JSON (up to 3
attempts, each bounded by ``metaserver_timeout_s``); `AsyncAnnouncer` runs posts on a small
thread pool so the scheduler never blocks on the network, and hands failures back to the scheduler,
which then fails the request (reported finished, every block invalid) instead of waiting forever.

TLS (``tls_config``): ``ssl_enable`` requires an ``https://`` URL; ``ssl_ca_certs`` verifies the
server (default: the system store); ``ssl_certfile`` / ``ssl_keyfile`` / ``ssl_keyfile_password``
present a client certificate. Host names are always verified.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, TransferError
from ascend_dist.kv_mooncake.push.config import TlsConfig

__all__ = ["AsyncAnnouncer", "HttpMetaserver", "Metaserver"]

logger = logging.getLogger(__name__)

_ATTEMPTS = 3
_RETRY_DELAY_S = 0.1


class Metaserver(Protocol):
    """Where D announces a request's blocks (the proxy's ``/v1/metaserver``)."""

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

    def __init__(self, tls: TlsConfig, *, timeout_s: float = 5.0) -> None:
        """Prepare the client; the SSL context is built once.

        Raises:
            ConfigError: Bad TLS files.
        """
        self._tls = tls
        self._timeout_s = timeout_s
        self._ctx = ssl_context(tls) if tls.ssl_enable else None

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
        for attempt in range(1, _ATTEMPTS + 1):
            req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self._timeout_s, context=self._ctx) as resp:
                    resp.read()
                return
            except urllib.error.HTTPError as exc:
                reason, timed_out = f"HTTP {exc.code}", False
            except (TimeoutError, urllib.error.URLError, OSError) as exc:
                inner = getattr(exc, "reason", exc)
                timed_out = isinstance(inner, TimeoutError)
                reason = f"{type(inner).__name__}: {inner}"
            logger.debug("metaserver POST %s attempt %d/%d failed: %s", url, attempt, _ATTEMPTS, reason)
            if attempt < _ATTEMPTS:
                time.sleep(_RETRY_DELAY_S)
        if timed_out:
            raise DeadlineExceeded(f"metaserver {url}: no answer in {_ATTEMPTS} attempts of {self._timeout_s} s")
        raise TransferError(f"metaserver {url} failed {_ATTEMPTS} times: {reason}")


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
