"""Authenticated frames on the pull side channel: a real P (its own process) with the deployment secret.

D (this process) shares the secret through the environment and transfers as usual; a stranger
without it, or with another key, is refused by P before any handler runs, and learns nothing of P's
handshake or memory (no `MetaReply`); a member's frame captured and replayed, edited, or stamped
outside the window is refused too. The frame attacks themselves (forged, replayed, stale) are in
the root ``tests/test_attacks.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from ascend_dist.common.errors import PeerNotAuthenticated
from ascend_dist.common.frame_auth import FrameAuth
from ascend_dist.common.secret import SECRET_ENV, SECRET_FILE_ENV, DeploymentSecret
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import (
    KIND_REFUSED,
    KIND_REPLY,
    KIND_REQUEST,
    pack_header,
    tcp_endpoint,
    unpack_header,
)
from ascend_dist.kv_mooncake.core.messages import GetMeta, MetaReply
from ascend_dist.kv_mooncake.pull.messages import reply_codec, request_codec

KEY = bytes(range(7, 39))


def _send(endpoint: str, frames: list[bytes]) -> tuple[tuple[int, int] | None, bytes]:
    """One hand-built request on a fresh DEALER: the reply's (kind, id) and body."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        assert sock.poll(5000, zmq.POLLIN), "P did not answer within 5 s"
        reply = sock.recv_multipart()
        return unpack_header(reply[1]), reply[2]
    finally:
        sock.close(linger=0)


def _sealed(auth: FrameAuth, payload: bytes) -> list[bytes]:
    header = pack_header(KIND_REQUEST, 9)
    return [b"", header, payload, auth.seal_request(header, payload)]


@pytest.mark.timeout(90)
def test_p_with_the_secret_serves_d_and_refuses_strangers(
    make_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, KEY.hex())  # P's process inherits it; D reads it here
    pair = make_pair(p_tp=1, d_tp=1, own_process=True)
    assert pair.transfer("before", 40, seed=1) == set() and pair.d.verify("before", 1) > 0
    endpoint = tcp_endpoint("127.0.0.1", pair.kv_port)
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)
    handshake = pair.d.ranks[0].worker.make_handshake(16)
    ask = requests.encode(GetMeta(handshake=handshake, engine_id="D-stranger"))
    for secret, reason in ((None, "missing"), (DeploymentSecret(bytes(range(32))), "mac")):
        stranger = RpcClient(timeout_s=2.0, retries=1, secret=secret)
        with stranger, pytest.raises(PeerNotAuthenticated) as refused:
            stranger.request(endpoint, ask)
        assert refused.value.reason == reason
    # A captured member frame: served once, refused when replayed, edited or stamped too early.
    captured = _sealed(FrameAuth(DeploymentSecret(KEY)), ask)
    assert _send(endpoint, captured)[0] == (KIND_REPLY, 9)
    kind, why = _send(endpoint, captured)
    assert kind == (KIND_REFUSED, 9) and why.startswith(b"replay:")
    edited = [*captured[:2], ask.replace(b"D-stranger", b"D-strangex"), captured[3]]
    kind, why = _send(endpoint, edited)
    assert kind == (KIND_REFUSED, 9) and why.startswith(b"mac:")
    early = FrameAuth(DeploymentSecret(KEY), clock_ns=lambda: time.time_ns() - 60 * 10**9)
    kind, why = _send(endpoint, _sealed(early, ask))
    assert kind == (KIND_REFUSED, 9) and why.startswith(b"stale:")
    # Control: the same GetMeta with the deployment's key is answered with P's metadata.
    with RpcClient(timeout_s=2.0, retries=1, secret=DeploymentSecret(KEY)) as member:
        assert isinstance(replies.decode(member.request(endpoint, ask)), MetaReply)
    assert pair.transfer("after", 40, seed=2) == set() and pair.d.verify("after", 2) > 0
