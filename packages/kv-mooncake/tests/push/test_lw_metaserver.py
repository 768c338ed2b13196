"""D's metaserver client against a real local HTTP(S) server started by the test (TLS with a test CA)."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, PeerNotAuthenticated, TransferError
from ascend_dist.common.frame_auth import HTTP_AUTH_HEADER, FrameAuth
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.kv_mooncake.core.metaserver import HttpMetaserver
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.push.config import TlsConfig
from ascend_dist.kv_mooncake.push.scheduler import LayerwiseScheduler


class _Proxy(http.server.BaseHTTPRequestHandler):
    received: list[dict[str, Any]]
    status = 200

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/metaserver":
            self.received.append(json.loads(body))
        self.send_response(self.status if self.path == "/v1/metaserver" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(ctx: ssl.SSLContext | None = None, status: int = 200) -> tuple[http.server.ThreadingHTTPServer, list]:
    received: list[dict[str, Any]] = []
    handler = type("H", (_Proxy,), {"received": received, "status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if ctx is not None:
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, received


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    out = {}
    for name in ("server", "other"):
        cert, key = d / f"{name}.pem", d / f"{name}.key"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
                "-addext",
                "subjectAltName=IP:127.0.0.1",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        out[name], out[f"{name}_key"] = cert, key
    return out


@pytest.fixture
def servers() -> Iterator[list[http.server.ThreadingHTTPServer]]:
    made: list[http.server.ThreadingHTTPServer] = []
    yield made
    for s in made:
        s.shutdown()
        s.server_close()


def test_plain_http_post_and_the_d_scheduler_announces_through_it(servers: list) -> None:
    server, received = _serve()
    servers.append(server)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/metaserver"
    HttpMetaserver(TlsConfig(), timeout_s=2.0).post(url, {"request_id": "x"})
    assert received == [{"request_id": "x"}]
    from ascend_dist.kv_mooncake.push.config import LayerwiseConfig

    cfg = LayerwiseConfig.from_kv_transfer_config(
        engine_id="D",
        kv_role="kv_consumer",
        kv_port=41000,
        extra={"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}},
    )
    sched = LayerwiseScheduler(cfg, [16])  # the default client: HTTP with the configured TLS
    try:
        req = SchedRequest("r7", 33, {"do_remote_prefill": True, "metaserver": url})
        assert sched.get_num_new_matched_tokens(req, 0) == (33, True)
        sched.update_state_after_alloc(req, [[5, 6, 7]], 33)
        deadline = time.monotonic() + 10
        while len(received) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sched.close()
    posted = received[1]
    assert posted["request_id"] == "r7" and posted["remote_block_ids"] == [[5, 6, 7]]
    assert (posted["remote_host"], posted["remote_port"], posted["remote_tp_size"]) == ("127.0.0.1", 41000, 1)
    assert posted["do_remote_decode"] is True and posted["do_remote_prefill"] is False


def test_https_with_ca_and_client_certificate(certs: dict[str, Path], servers: list) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs["other"]))
    ctx.load_cert_chain(str(certs["server"]), str(certs["server_key"]))
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS: the client presents the "other" certificate
    server, received = _serve(ctx)
    servers.append(server)
    url = f"https://127.0.0.1:{server.server_address[1]}/v1/metaserver"
    tls = TlsConfig(
        ssl_enable=True,
        ssl_ca_certs=str(certs["server"]),
        ssl_certfile=str(certs["other"]),
        ssl_keyfile=str(certs["other_key"]),
    )
    HttpMetaserver(tls, timeout_s=5.0).post(url, {"request_id": "tls"})
    assert received == [{"request_id": "tls"}]
    wrong_ca = TlsConfig(
        ssl_enable=True,
        ssl_ca_certs=str(certs["other"]),
        ssl_certfile=str(certs["other"]),
        ssl_keyfile=str(certs["other_key"]),
    )
    with pytest.raises(TransferError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        HttpMetaserver(wrong_ca, timeout_s=5.0).post(url, {"request_id": "no"})
    with pytest.raises(ConfigError) as info:
        HttpMetaserver(tls).post(url.replace("https", "http"), {})
    assert info.value.field == "kv_transfer_params.metaserver"
    with pytest.raises(ConfigError) as info:
        HttpMetaserver(TlsConfig(ssl_enable=True, ssl_ca_certs="/nonexistent.pem"))
    assert info.value.field == "tls_config.ssl_ca_certs"


def test_error_status_and_silent_server_end_within_the_deadline(servers: list) -> None:
    server, _ = _serve(status=503)
    servers.append(server)
    with pytest.raises(TransferError, match="HTTP 503"):
        HttpMetaserver(TlsConfig(), timeout_s=2.0).post(
            f"http://127.0.0.1:{server.server_address[1]}/v1/metaserver", {}
        )
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    try:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            HttpMetaserver(TlsConfig(), timeout_s=0.3).post(f"http://127.0.0.1:{silent.getsockname()[1]}/m", {})
        assert time.monotonic() - start < 3.0
    finally:
        silent.close()


def _verifying_server(auth: Any) -> tuple[http.server.ThreadingHTTPServer, list[str]]:
    """A metaserver that holds the secret: 200 for a POST whose MAC header verifies, else 401 + reason."""
    outcomes: list[str] = []

    class Verifying(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                auth.check_http("POST", self.path, body, self.headers.get(HTTP_AUTH_HEADER))
            except PeerNotAuthenticated as exc:
                outcomes.append(exc.reason)
                self.send_response(401)
            else:
                outcomes.append("ok")
                self.send_response(200)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Verifying)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server, outcomes


def test_posts_carry_a_mac_the_metaserver_verifies_and_a_stranger_or_replay_fails() -> None:
    key = DeploymentSecret(bytes(range(32)))
    server, outcomes = _verifying_server(FrameAuth(key))
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/metaserver?x=1"
    try:
        HttpMetaserver(attempts=1, secret=key).post(url, {"request_id": "r1"})
        with pytest.raises(TransferError, match="HTTP 401"):  # control: no secret, no header
            HttpMetaserver(attempts=1, secret=None).post(url, {"request_id": "r2"})
        with pytest.raises(TransferError, match="HTTP 401"):
            HttpMetaserver(attempts=1, secret=DeploymentSecret(bytes(32))).post(url, {"request_id": "r3"})
        # A captured POST sent again verbatim is a replay.
        body = json.dumps({"request_id": "r4"}).encode()
        header = FrameAuth(key).seal_http("POST", "/v1/metaserver?x=1", body)
        for _ in range(2):
            req = urllib.request.Request(url, data=body, method="POST", headers={HTTP_AUTH_HEADER: header})
            try:
                urllib.request.urlopen(req, timeout=5).close()
            except urllib.error.HTTPError as exc:  # the replay's 401
                exc.close()
    finally:
        server.shutdown()
        server.server_close()
    assert outcomes == ["ok", "missing", "mac", "ok", "replay"]
