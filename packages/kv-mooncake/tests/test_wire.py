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
