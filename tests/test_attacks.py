"""Attack suite: hostile frames against real servers on 127.0.0.1, each refused in bounded time
while legitimate traffic is still served (issues 23 and 24). More cases live with their packages:
``packages/common/tests/wire/test_wire_rpc_bounds.py`` (floods, slow senders, log flooding),
``packages/kv-mooncake/tests/test_wire.py`` (channel binding, other wire versions, bounded fields,
refusals without our values), ``packages/kv-mooncake/tests/test_pd_failures.py`` (a real P),
``packages/kv-mooncake/tests/test_pd_capabilities.py`` (signed pull capabilities against a real P:
block ids widened to another live request's, forged ``Renew`` and ``Done``) and
``packages/kv-mooncake/tests/push/test_lw_capabilities.py`` (signed push announcements)."""

from __future__ import annotations

import logging
import resource
import threading
from typing import Any

import msgspec
import pytest
import zmq

from ascend_dist.common.errors import PeerNotAuthenticated
from ascend_dist.common.frame_auth import FrameAuth
from ascend_dist.common.secret import SECRET_ENV, DeploymentSecret
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import KIND_REFUSED, KIND_REPLY, KIND_REQUEST, pack_header, unpack_header
from ascend_dist.kv_store import LookupClient, LookupServer
from ascend_dist.kv_store.lookup.messages import LookupCodec, LookupRequest, ReplyCodec
from ascend_dist.testing.ports import free_port

COMPAT = "c" * 64


def _lookup_frame(**fields: Any) -> bytes:
    return msgspec.msgpack.encode({"kind": "lookup", "compat_hash": COMPAT, "token_len": 64, **fields})


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "fields",
    [
        {"hbm_hit_tokens": -(10**9)},  # upstream-style range(known, n): ~3 GiB before this was checked
        {"token_len": -1},
        {"token_len": 2**62},
        {"group_ids": [10**9]},
        {"group_ids": []},
        {"block_hashes": [b"h" * 4096]},
        {"tail_hash": b"t" * 4096},
    ],
    ids=lambda f: next(iter(f)),
)
def test_lookup_fields_out_of_range_are_refused_before_the_lookup_runs(fields: dict[str, Any]) -> None:
    asked: list[LookupRequest] = []

    def lookup(req: LookupRequest) -> int:
        asked.append(req)
        return req.token_len

    server = LookupServer(lookup, COMPAT, host="127.0.0.1", port=free_port())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with RpcClient(timeout_s=10.0, retries=1) as client:
            reply = ReplyCodec.decode(client.request(server.endpoint, _lookup_frame(**fields)))
            assert reply.hit_tokens == 0 and reply.error and not asked
            # Control: the same frame with legal values reaches the lookup and is answered.
            good = LookupCodec.encode(LookupRequest(compat_hash=COMPAT, token_len=64, block_hashes=(b"h" * 32,)))
            assert ReplyCodec.decode(client.request(server.endpoint, good)).hit_tokens == 64 and len(asked) == 1
    finally:
        server.close()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024  # KiB: < 200 MiB


@pytest.mark.timeout(60)
def test_a_junk_flood_is_logged_once_per_interval_and_lookups_are_still_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = LookupServer(lambda req: req.token_len, COMPAT, host="127.0.0.1", port=free_port())
    threads_before = threading.active_count()
    good = LookupCodec.encode(LookupRequest(compat_hash=COMPAT, token_len=32))
    try:
        with caplog.at_level(logging.WARNING), RpcClient(timeout_s=10.0, retries=1) as client:
            for i in range(2000):  # 16-byte junk frames, each answered with an error reply
                reply = ReplyCodec.decode(client.request(server.endpoint, b"\xc1" + i.to_bytes(15, "big")))
                assert reply.hit_tokens == 0 and reply.error
                if i % 500 == 0:  # legitimate lookups in between are answered correctly
                    assert ReplyCodec.decode(client.request(server.endpoint, good)).hit_tokens == 32
    finally:
        server.close()
    lines = [r for r in caplog.records if "undecodable" in r.getMessage() or "refused a request" in r.getMessage()]
    assert len(lines) <= 2  # one line per 10 s interval (maybe spent by an earlier test), not 2,000
    assert not any(r.exc_info for r in caplog.records)  # no tracebacks
    assert threading.active_count() <= threads_before


# --- authenticated frames (issue 23 item 2): a real lookup server with the deployment secret on ---

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def _raw_exchange(endpoint: str, frames: list[bytes], timeout_s: float = 5.0) -> list[bytes]:
    """Send one hand-built request on a fresh DEALER and return the reply's frames."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        assert sock.poll(int(timeout_s * 1000), zmq.POLLIN), "no answer before the deadline"
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)


def _sealed(auth: FrameAuth, payload: bytes, request_id: int = 7) -> list[bytes]:
    header = pack_header(KIND_REQUEST, request_id)
    return [b"", header, payload, auth.seal_request(header, payload)]


def _stale_clock() -> int:
    import time

    return time.time_ns() - 120 * 10**9  # two minutes behind: outside the 30 s window


def _lookup(token_len: int) -> bytes:
    return LookupCodec.encode(LookupRequest(compat_hash=COMPAT, token_len=token_len, block_hashes=(b"h" * 32,)))


def _forged(auth: FrameAuth) -> list[bytes]:
    frames = _sealed(auth, _lookup(64))
    frames[2] = _lookup(4096)  # the MAC was made over token_len 64: an edited frame
    return frames


def _replayed(auth: FrameAuth, endpoint: str) -> list[bytes]:
    frames = _sealed(auth, _lookup(64))
    first = _raw_exchange(endpoint, frames)  # the legitimate original is served ...
    assert unpack_header(first[1]) == (KIND_REPLY, 7)
    return frames  # ... and the very same frames are sent again


ATTACKS: dict[str, tuple[str, Any]] = {
    "no-mac": ("missing", lambda auth, ep: [b"", pack_header(KIND_REQUEST, 7), _lookup(64)]),
    "forged": ("mac", lambda auth, ep: _forged(auth)),
    "replayed": ("replay", _replayed),
    "stale": ("stale", lambda auth, ep: _sealed(FrameAuth(DeploymentSecret(KEY), clock_ns=_stale_clock), _lookup(64))),
    "other-key": ("mac", lambda auth, ep: _sealed(FrameAuth(DeploymentSecret(OTHER_KEY)), _lookup(64))),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_frames_without_a_valid_mac_are_refused_while_authenticated_lookups_are_served(
    attack: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, KEY.hex())  # every node of the deployment shares it
    asked: list[int] = []

    def lookup(req: LookupRequest) -> int:
        asked.append(req.token_len)
        return req.token_len

    server = LookupServer(lookup, COMPAT, host="127.0.0.1", port=free_port())
    try:
        reason, build = ATTACKS[attack]
        frames = build(FrameAuth(DeploymentSecret(KEY)), server.endpoint)
        served_before = len(asked)
        reply = _raw_exchange(server.endpoint, frames)
        assert unpack_header(reply[1]) == (KIND_REFUSED, 7)  # refused, and told why (not our key)
        assert reply[2].decode().startswith(reason + ":")
        assert len(asked) == served_before  # the lookup never saw the frame
        # Control: the legitimate client (secret from the same environment) is served at once.
        client = LookupClient(COMPAT, host="127.0.0.1", port=int(server.endpoint.rsplit(":", 1)[1]), in_process=False)
        try:
            assert client.lookup(96, (b"h" * 32,)) == 96 and client.failures == 0
        finally:
            client.close()
    finally:
        server.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("client_key", "reason"), [(None, "missing"), (OTHER_KEY, "mac")])
def test_a_peer_without_the_secret_gets_a_typed_refusal(
    client_key: bytes | None, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, KEY.hex())
    server = LookupServer(lambda req: req.token_len, COMPAT, host="127.0.0.1", port=free_port())
    secret = None if client_key is None else DeploymentSecret(client_key)
    try:
        with RpcClient(timeout_s=5.0, retries=3, secret=secret) as stranger:
            with pytest.raises(PeerNotAuthenticated) as refused:
                stranger.request(server.endpoint, _lookup(64))
            assert refused.value.reason == reason
        with RpcClient(timeout_s=5.0, retries=1, secret=DeploymentSecret(KEY)) as member:
            assert ReplyCodec.decode(member.request(server.endpoint, _lookup(64))).hit_tokens == 64
    finally:
        server.close()


@pytest.mark.timeout(30)
def test_a_client_with_the_secret_refuses_a_server_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    served: list[int] = []
    server = LookupServer(lambda req: served.append(1) or req.token_len, COMPAT, host="127.0.0.1", port=free_port())
    try:
        member = RpcClient(timeout_s=5.0, retries=1, secret=DeploymentSecret(KEY))
        with member, pytest.raises(PeerNotAuthenticated) as refused:
            member.request(server.endpoint, _lookup(64))
        assert refused.value.reason == "unexpected" and not served  # never half-served
    finally:
        server.close()
