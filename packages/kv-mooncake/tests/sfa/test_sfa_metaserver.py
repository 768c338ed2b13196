"""D's metaserver client against a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from ascend_dist.kv_mooncake.core.metaserver import DELIVERED_MEMORY, RetryingAnnouncer
from ascend_dist.kv_mooncake.sfa.messages import ContactInfo, parse_contact

_CONTACT = ContactInfo(request_id="r", remote_engine_id="d", remote_host="127.0.0.1", remote_port=9, remote_tp_size=1)


class _Proxy:
    def __init__(self, port: int = 0, status: int = 200) -> None:
        self.got: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append(json.loads(body))
                self.send_response(status)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def client() -> Iterator[RetryingAnnouncer]:
    c = RetryingAnnouncer(timeout_s=0.5, attempts=2, retry_s=0.2)
    yield c
    c.close()


def _wait(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_post_delivers_contact_json(client: RetryingAnnouncer) -> None:
    proxy = _Proxy()
    try:
        client.post("r", _CONTACT, proxy.url)
        _wait(lambda: list(client.delivered) == ["r"])
        assert parse_contact(proxy.got[0]) == _CONTACT
    finally:
        proxy.close()


def test_http_error_counts_as_delivered(client: RetryingAnnouncer) -> None:
    proxy = _Proxy(status=500)
    try:
        client.post("r", _CONTACT, proxy.url)
        _wait(lambda: list(client.delivered) == ["r"])
    finally:
        proxy.close()


def test_transport_failure_is_retried_until_the_proxy_comes_up(client: RetryingAnnouncer) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client.post("r", _CONTACT, f"http://127.0.0.1:{port}/v1/metaserver")
    time.sleep(0.5)  # a couple of failed rounds
    assert not client.delivered
    proxy = _Proxy(port=port)
    try:
        _wait(lambda: list(client.delivered) == ["r"])
        assert len(proxy.got) == 1
    finally:
        proxy.close()


def test_cancel_stops_the_retries(client: RetryingAnnouncer) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client.post("r", _CONTACT, f"http://127.0.0.1:{port}/v1/metaserver")
    client.cancel("r")
    proxy = _Proxy(port=port)
    try:
        time.sleep(0.6)
        assert proxy.got == [] and not client.delivered
    finally:
        proxy.close()


def test_close_stops_retrying_and_joins_the_thread() -> None:
    c = RetryingAnnouncer(timeout_s=0.2, attempts=1, retry_s=0.05)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    c.post("r", _CONTACT, f"http://127.0.0.1:{port}/v1/metaserver")
    time.sleep(0.2)
    c.close()
    assert not c.running
    assert not c.delivered


class _CountingMetaserver:
    """Our `Metaserver` Protocol: accepts every post at once."""

    def __init__(self) -> None:
        self.posts = 0

    def post(self, url: str, payload: Any) -> None:
        self.posts += 1


def test_announcer_memory_stays_bounded_over_many_requests() -> None:
    """It kept every delivered id forever (a leak over a long-running D); now the latest 1,024 and a count."""
    sink = _CountingMetaserver()
    announcer = RetryingAnnouncer(metaserver=sink)
    try:
        for i in range(DELIVERED_MEMORY + 500):
            announcer.post(f"r{i}", _CONTACT, "http://127.0.0.1:1/unused")
        _wait(lambda: announcer.delivered_count == DELIVERED_MEMORY + 500, timeout_s=20.0)
        assert len(announcer.delivered) == DELIVERED_MEMORY and announcer.delivered[-1] == f"r{DELIVERED_MEMORY + 499}"
        assert sink.posts == DELIVERED_MEMORY + 500
    finally:
        announcer.close()
