"""D's metaserver client: posts a request's contact info to the proxy, with bounded retries.

Runs in: D's scheduler process, on one background thread (joined by `close`). A post is JSON over
HTTP (stdlib ``urllib``; no pickle): up to ``attempts`` transport attempts of ``timeout_s`` each;
an HTTP error status counts as delivered (legacy proxies answer 500 for extra prompt-list
children); after a transport failure the whole post is tried again ``retry_s`` later, until the
request is cancelled (it finished) or the client is closed. At most one post per request is
pending. The scheduler never blocks on the network.
"""

from __future__ import annotations

import heapq
import json
import logging
import threading
import time
import urllib.error
import urllib.request

import msgspec

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.sfa.messages import ContactInfo

__all__ = ["MetaserverClient"]

logger = logging.getLogger(__name__)


class MetaserverClient:
    """A `ContactSink` posting to the URL each request carries (``kv_transfer_params["metaserver"]``)."""

    def __init__(self, *, timeout_s: float = 2.0, attempts: int = 3, retry_s: float = 1.0) -> None:
        """Start the posting thread.

        Raises:
            ConfigError: A bound is not positive.
        """
        if timeout_s <= 0 or attempts < 1 or retry_s < 0:
            raise ConfigError("metaserver client", (timeout_s, attempts, retry_s), "timeout_s > 0, attempts >= 1")
        self._timeout_s, self._attempts, self._retry_s = timeout_s, attempts, retry_s
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, str]] = []
        self._pending: dict[str, tuple[str, bytes]] = {}
        self._seq = 0
        self._closed = False
        self.delivered: list[str] = []
        self._thread = threading.Thread(target=self._run, name="sfa-metaserver", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the posting thread is alive."""
        return self._thread.is_alive()

    def post(self, ext_id: str, contact: ContactInfo, url: str | None = None) -> None:
        """Queue the post of ``contact`` to ``url`` (a request without a metaserver URL is logged)."""
        if not url:
            logger.warning("sfa: request %s has no metaserver URL; P cannot learn where to send", ext_id)
            return
        with self._cond:
            if self._closed or ext_id in self._pending:
                return
            self._pending[ext_id] = (url, json.dumps(msgspec.to_builtins(contact)).encode())
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
            ok = self._send(ext_id, *job)
            with self._cond:
                if ext_id not in self._pending:
                    continue
                if ok:
                    del self._pending[ext_id]
                    self.delivered.append(ext_id)
                elif not self._closed:
                    self._schedule(ext_id, self._retry_s)

    def _send(self, ext_id: str, url: str, body: bytes) -> bool:
        for attempt in range(1, self._attempts + 1):
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self._timeout_s) as resp:
                    resp.read()
                return True
            except urllib.error.HTTPError as exc:  # the proxy answered: delivered
                logger.info("sfa metaserver answered %d for %s; treated as delivered", exc.code, ext_id)
                return True
            except (urllib.error.URLError, OSError) as exc:
                logger.warning("sfa metaserver post %d/%d for %s failed: %s", attempt, self._attempts, ext_id, exc)
        return False

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop retrying and join the thread (a post in flight ends within its timeout)."""
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()
        self._thread.join(timeout_s)
