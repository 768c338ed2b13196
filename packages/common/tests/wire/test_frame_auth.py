"""`FrameAuth`: tags, the timestamp window and the bounded replay cache, with a controllable clock."""

from __future__ import annotations

import pytest

from ascend_dist.common.errors import ConfigError, PeerNotAuthenticated
from ascend_dist.common.frame_auth import AUTH_BYTES, FrameAuth
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.zmq_server import KIND_REPLY, KIND_REQUEST, pack_header

SECRET = DeploymentSecret(b"k" * 32)
HEADER = pack_header(KIND_REQUEST, 1)


class Clock:
    def __init__(self) -> None:
        self.ns = 1_700_000_000 * 10**9

    def __call__(self) -> int:
        return self.ns


def test_a_sealed_request_verifies_once_and_its_reply_is_bound_to_it() -> None:
    clock = Clock()
    client, server = FrameAuth(SECRET, clock_ns=clock), FrameAuth(SECRET, clock_ns=clock)
    auth = client.seal_request(HEADER, b"payload")
    assert len(auth) == AUTH_BYTES
    nonce = server.check_request(HEADER, b"payload", auth)
    with pytest.raises(PeerNotAuthenticated, match="replay"):
        server.check_request(HEADER, b"payload", auth)
    reply_header = pack_header(KIND_REPLY, 1)
    tag = server.seal_reply(nonce, reply_header, b"answer")
    client.check_reply(nonce, reply_header, b"answer", tag)
    with pytest.raises(PeerNotAuthenticated) as wrong:  # the same reply can never answer another request
        client.check_reply(b"n" * 16, reply_header, b"answer", tag)
    assert wrong.value.reason == "mac"
    with pytest.raises(PeerNotAuthenticated) as missing:
        client.check_reply(nonce, reply_header, b"answer", None)
    assert missing.value.reason == "missing"


@pytest.mark.parametrize(
    "edit",
    [
        lambda h, p, a: (pack_header(KIND_REQUEST, 2), p, a),  # another request id
        lambda h, p, a: (h, p + b"!", a),  # an edited payload
        lambda h, p, a: (h, p, a[:8] + bytes(16) + a[24:]),  # another nonce under the same tag
        lambda h, p, a: (h, p, a[:-1]),  # a truncated auth frame
    ],
)
def test_any_edit_of_a_sealed_frame_fails_the_mac(edit: object) -> None:
    server = FrameAuth(SECRET)
    header, payload, auth = edit(HEADER, b"payload", FrameAuth(SECRET).seal_request(HEADER, b"payload"))  # type: ignore[operator]
    with pytest.raises(PeerNotAuthenticated) as refused:
        server.check_request(header, payload, auth)
    assert refused.value.reason == "mac" and server.remembered == 0  # nothing cached for a stranger


def test_timestamps_outside_the_window_are_stale_either_way() -> None:
    clock = Clock()
    server = FrameAuth(SECRET, window_s=30, clock_ns=clock)
    for shift_s in (-31, 31):
        sender = Clock()
        sender.ns = clock.ns + shift_s * 10**9
        with pytest.raises(PeerNotAuthenticated, match="stale"):
            server.check_request(HEADER, b"p", FrameAuth(SECRET, clock_ns=sender).seal_request(HEADER, b"p"))
    sender = Clock()
    sender.ns = clock.ns - 29 * 10**9  # inside the window: accepted
    server.check_request(HEADER, b"p", FrameAuth(SECRET, clock_ns=sender).seal_request(HEADER, b"p"))


def test_the_replay_cache_is_bounded_and_never_readmits_an_evicted_nonce() -> None:
    clock = Clock()
    server = FrameAuth(SECRET, max_nonces=4, clock_ns=clock)
    sealed = []
    for _ in range(10):
        clock.ns += 1000
        auth = FrameAuth(SECRET, clock_ns=clock).seal_request(HEADER, b"p")
        server.check_request(HEADER, b"p", auth)
        sealed.append(auth)
    assert server.remembered <= 4
    for auth in sealed:  # evicted or remembered: each replay is refused
        with pytest.raises(PeerNotAuthenticated) as refused:
            server.check_request(HEADER, b"p", auth)
        assert refused.value.reason in ("stale", "replay")
    clock.ns += 31 * 10**9  # the window passes: expired nonces leave the cache
    server.check_request(HEADER, b"p", FrameAuth(SECRET, clock_ns=clock).seal_request(HEADER, b"p"))
    assert server.remembered == 1


def test_bad_bounds_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="window_s"):
        FrameAuth(SECRET, window_s=0)
    with pytest.raises(ConfigError, match="max_nonces"):
        FrameAuth(SECRET, max_nonces=0)


@pytest.mark.parametrize(
    ("header", "reason"),
    [(None, "missing"), ("", "missing"), ("v2 1 2 3", "mac"), ("v1 zz 00 00", "mac"), ("v1 1 00", "mac")],
)
def test_malformed_http_auth_headers_are_refused(header: str | None, reason: str) -> None:
    with pytest.raises(PeerNotAuthenticated) as refused:
        FrameAuth(SECRET).check_http("POST", "/v1/metaserver", b"{}", header)
    assert refused.value.reason == reason


def test_an_http_mac_is_bound_to_method_path_and_body_and_never_passes_as_a_frame() -> None:
    server = FrameAuth(SECRET)
    value = FrameAuth(SECRET).seal_http("POST", "/v1/metaserver", b"{}")
    edits = (("PUT", "/v1/metaserver", b"{}"), ("POST", "/v1/other", b"{}"), ("POST", "/v1/metaserver", b"[]"))
    for method, path, body in edits:
        with pytest.raises(PeerNotAuthenticated, match="mac"):
            server.check_http(method, path, body, value)
    _, ts, nonce, tag = value.split(" ")
    as_frame = bytes.fromhex(f"{int(ts, 16):016x}") + bytes.fromhex(nonce) + bytes.fromhex(tag)
    with pytest.raises(PeerNotAuthenticated, match="mac"):
        server.check_request(HEADER, b"{}", as_frame)
    server.check_http("POST", "/v1/metaserver", b"{}", value)  # control: the untouched request passes


_TWO_SERVERS_AND_A_CLIENT = """
import logging
logging.basicConfig(level=logging.WARNING)
from ascend_dist.common.zmq_rpc import RpcClient, RpcServer
for name in ("a", "b"):
    server = RpcServer("127.0.0.1", 0, lambda p: p, name=name)
    print(name, server.authenticated)
    server.stop()
RpcClient().close()
"""


@pytest.mark.parametrize("with_secret", [False, True])
def test_without_a_secret_a_process_warns_once_with_one_it_authenticates_silently(with_secret: bool) -> None:
    import os
    import subprocess
    import sys

    from ascend_dist.common.secret import SECRET_ENV, SECRET_FILE_ENV

    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    if with_secret:
        env[SECRET_ENV] = "ab" * 32
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_SERVERS_AND_A_CLIENT],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["a", str(with_secret), "b", str(with_secret)]
    assert proc.stderr.count("peers are not authenticated") == (0 if with_secret else 1)


def test_every_mac_is_counted_in_the_process_auth_cost() -> None:
    """The pd bench reads `AUTH_COST` on both sides: a request and its reply are four MACs."""
    from ascend_dist.common.auth_cost import AUTH_COST

    clock = Clock()
    client, server = FrameAuth(SECRET, clock_ns=clock), FrameAuth(SECRET, clock_ns=clock)
    before = AUTH_COST.snapshot()
    nonce = server.check_request(HEADER, b"x" * 4096, client.seal_request(HEADER, b"x" * 4096))
    reply_header = pack_header(KIND_REPLY, 1)
    client.check_reply(nonce, reply_header, b"answer", server.seal_reply(nonce, reply_header, b"answer"))
    spent = AUTH_COST.snapshot().since(before)
    assert spent.ops == 4  # seal, check, seal the reply, check the reply
    assert spent.ns > 0
