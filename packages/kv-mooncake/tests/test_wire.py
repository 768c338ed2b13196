"""The one wire vocabulary: one tag, one version rule, one codec factory for pull, push and SFA."""

from __future__ import annotations

import typing

import msgspec
import pytest

from ascend_dist.common.errors import IncompatiblePeer, MessageTooLarge, ProtocolError
from ascend_dist.common.wire import make_handshake
from ascend_dist.kv_mooncake.core.messages import GetMeta, Refused, accept_reply, admit
from ascend_dist.kv_mooncake.core.wire import WIRE_VERSION, Channel, Message, Request
from ascend_dist.kv_mooncake.pull import messages as pull
from ascend_dist.kv_mooncake.push import messages as push
from ascend_dist.kv_mooncake.sfa import messages as sfa

CHANNELS = [pull.CHANNEL, push.CHANNEL, sfa.CHANNEL]


def _members(union: object) -> list[type]:
    return list(typing.get_args(union))


@pytest.mark.parametrize("channel", CHANNELS, ids=lambda c: c.name)
def test_every_message_is_tagged_on_kind_and_every_request_has_auth(channel: Channel) -> None:
    for cls in _members(channel.requests) + _members(channel.replies):
        assert issubclass(cls, Message) and cls.__struct_config__.tag_field == "kind", cls
    for cls in _members(channel.requests):
        assert issubclass(cls, Request) and "auth" in cls.__struct_fields__, cls


@pytest.mark.parametrize("channel", CHANNELS, ids=lambda c: c.name)
def test_codecs_are_strict_and_size_bounded(channel: Channel) -> None:
    requests, replies = channel.request_codec(256), channel.reply_codec(256)
    refused = Refused(field="dtype", local="a", remote="b")
    assert replies.decode(replies.encode(refused)) == refused
    with pytest.raises(ProtocolError):
        requests.decode(msgspec.msgpack.encode({"kind": "refused", "field": "x", "local": "", "remote": ""}))
    with pytest.raises(MessageTooLarge):
        requests.decode(b"\x00" * 257)


def test_the_handshake_rule_names_the_differing_field() -> None:
    local = pull.CHANNEL.handshake(sender="P", model="m", dtype="float16")
    ok = GetMeta(handshake=pull.CHANNEL.handshake(sender="D", model="m", dtype="float16"), engine_id="D")
    assert admit(local, "P", ok) is None
    cases = {
        "protocol_version": make_handshake(pull.CHANNEL.name, WIRE_VERSION + 1, model="m", dtype="float16"),
        "protocol": push.CHANNEL.handshake(sender="D", model="m", dtype="float16"),
        "dtype": pull.CHANNEL.handshake(sender="D", model="m", dtype="bfloat16"),
    }
    for field, handshake in cases.items():
        refused = admit(local, "P", GetMeta(handshake=handshake, engine_id="D"))
        assert refused is not None and refused.field == field
    same_engine = admit(local, "P", GetMeta(handshake=ok.handshake, engine_id="P"))
    assert same_engine is not None and same_engine.field == "engine_id"


def test_extra_checks_and_the_client_side() -> None:
    local = sfa.CHANNEL.handshake(sender="D", layers=2)

    def no_layers() -> None:
        raise IncompatiblePeer("layer l0", "present", "missing")

    greeting = GetMeta(handshake=sfa.CHANNEL.handshake(sender="P", layers=2), engine_id="P")
    refused = admit(local, "D", greeting, no_layers)
    assert refused is not None and refused.field == "layer l0"
    with pytest.raises(IncompatiblePeer, match="layer l0"):
        accept_reply(refused, sfa.HelloAck, local, "D")
    with pytest.raises(ProtocolError, match="expected HelloAck"):
        accept_reply(sfa.ReadDone(layer_idx=0), sfa.HelloAck, local, "D")
    assert accept_reply(sfa.HelloAck(receiver="d"), sfa.HelloAck, local, "D") == sfa.HelloAck(receiver="d")


def test_a_refusal_names_the_field_and_never_the_servers_value() -> None:
    local = pull.CHANNEL.handshake(sender="P", model="secret-model", dtype="float16")
    remote = pull.CHANNEL.handshake(sender="D", model="guess", dtype="float16")
    refused = admit(local, "P0", GetMeta(handshake=remote, engine_id="D0"))
    assert refused == Refused(field="model", remote="guess")
    assert "secret-model" not in str(msgspec.msgpack.encode(refused))
    with pytest.raises(IncompatiblePeer) as info:
        accept_reply(refused, GetMeta, remote, "P")
    assert info.value.field == "model" and "secret" not in str(info.value)


def _refusal(codec: typing.Any, frame: bytes) -> Refused:
    with pytest.raises(ProtocolError) as info:
        codec.decode(frame)
    assert info.value.reply is not None
    reply = push.CHANNEL.reply_codec(1 << 20).decode(info.value.reply)
    assert isinstance(reply, Refused)
    return reply


def test_a_pull_done_never_decodes_on_the_layerwise_channel_and_back() -> None:
    pull_done = pull.request_codec(1 << 20).encode(pull.Done(request_id="r", ok=True, d_rank=0))
    push_done = push.request_codec(1 << 20).encode(push.PushDone(request_id="r", ok=True, sender="p0", trans_count=1))
    assert _refusal(push.request_codec(1 << 20), pull_done).field == "$.kind"
    assert _refusal(pull.request_codec(1 << 20), push_done).field == "$.kind"
    # Control: each decodes on its own channel.
    assert isinstance(pull.request_codec(1 << 20).decode(pull_done), pull.Done)
    assert isinstance(push.request_codec(1 << 20).decode(push_done), push.PushDone)


@pytest.mark.parametrize("channel", CHANNELS, ids=lambda c: c.name)
def test_a_peer_of_another_wire_version_is_refused_naming_protocol_version(channel: Channel) -> None:
    # A version-1 style frame (another tag field) whose handshake names its version.
    old = {"type": "get_meta", "handshake": {"protocol": channel.name, "protocol_version": 1}, "engine_id": "X"}
    refused = _refusal(channel.request_codec(1 << 20), msgspec.msgpack.encode(old))
    assert refused == Refused(field="protocol_version", remote="1")
    junk = _refusal(channel.request_codec(1 << 20), b"\xc1\xc1")
    assert junk.field == "message" and junk.remote == ""


@pytest.mark.parametrize(
    "fields",
    [
        {"layers": [10**9]},
        {"layers": [-1]},
        {"layers": list(range(5000))},
        {"trans_count": 0},
        {"trans_count": 10**9},
        {"request_ids": ["x" * 10_000]},
        {"request_ids": ["r"] * 5000},
    ],
    ids=lambda f: next(iter(f)),
)
def test_layer_done_fields_are_bounded_before_anything_is_allocated(fields: dict[str, typing.Any]) -> None:
    msg = {"kind": "layer_done", "sender": "p0", "layers": [0], "request_ids": ["r"], "trans_count": 1}
    codec = push.request_codec(1 << 20)
    assert isinstance(codec.decode(msgspec.msgpack.encode(msg)), push.LayerDone)  # control
    with pytest.raises(ProtocolError):
        codec.decode(msgspec.msgpack.encode({**msg, **fields}))


def test_pull_lease_fields_round_trip_older_frames_decode_and_hostile_leases_are_refused() -> None:
    """Readers, promised leases and P's process (no version bump: an older peer's frames decode with
    the defaults, which mean "no reader named", "no promise" and "not said", so D checks again after
    every read and reads with the metadata it cached)."""
    requests, replies = pull.request_codec(1 << 20), pull.reply_codec(1 << 20)
    renew = pull.Renew(request_ids=["a", "b"], d_rank=1, senders=["pcp0/-1"] * 2, readers=["r1", "r2"])
    assert requests.decode(requests.encode(renew)) == renew
    held = pull.Held(held=[True, False], lease_s=[59.5, 0.0], incarnation="0123abcd")
    assert replies.decode(replies.encode(held)) == held
    older = requests.decode(msgspec.msgpack.encode({"kind": "renew", "request_ids": ["a"]}))
    assert isinstance(older, pull.Renew) and (older.d_rank, older.senders, older.readers) == (0, [], [])
    older_held = replies.decode(msgspec.msgpack.encode({"kind": "pull_held", "held": [True]}))
    assert isinstance(older_held, pull.Held) and (older_held.lease_s, older_held.incarnation) == ([], "")
    with pytest.raises(ProtocolError):  # P's process token is bounded like `AgentMetadata.incarnation`
        replies.decode(msgspec.msgpack.encode({"kind": "pull_held", "held": [True], "incarnation": "x" * 100}))
    for lease in (-1.0, float("nan"), float("inf"), 1e9):
        with pytest.raises(ProtocolError):
            replies.decode(msgspec.msgpack.encode({"kind": "pull_held", "held": [True], "lease_s": [lease]}))
    with pytest.raises(ProtocolError):
        requests.decode(msgspec.msgpack.encode({"kind": "renew", "request_ids": ["a"], "readers": ["x" * 10_000]}))
