"""Codec: round trips, strict typing, size bound, and schema evolution."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError, MessageTooLarge, ProtocolError
from ascend_dist.common.wire import DEFAULT_MAX_MESSAGE_BYTES, Codec


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    pass


class PullRequest(_Msg, frozen=True, kw_only=True, tag="pull"):
    request_id: str
    block_ids: tuple[int, ...]
    tp_rank: int = 0


class PullDone(_Msg, frozen=True, kw_only=True, tag="done"):
    request_id: str


Message = PullRequest | PullDone
CODEC = Codec[Message](Message)


class Point(msgspec.Struct, frozen=True, kw_only=True):
    x: int
    y: int


class PointV2(msgspec.Struct, frozen=True, kw_only=True):
    x: int
    y: int
    label: str = "none"


def test_default_bound_is_16_mib() -> None:
    assert DEFAULT_MAX_MESSAGE_BYTES == 16 * 1024 * 1024
    assert Codec(Point).max_bytes == DEFAULT_MAX_MESSAGE_BYTES


def test_struct_round_trip() -> None:
    codec = Codec(Point)
    assert codec.decode(codec.encode(Point(x=1, y=-2))) == Point(x=1, y=-2)


def test_tagged_union_decodes_to_the_struct_its_tag_names() -> None:
    pull = PullRequest(request_id="r1", block_ids=(3, 4, 5), tp_rank=2)
    done = PullDone(request_id="r1")
    decoded_pull = CODEC.decode(CODEC.encode(pull))
    decoded_done = CODEC.decode(CODEC.encode(done))
    assert type(decoded_pull) is PullRequest
    assert decoded_pull == pull
    assert type(decoded_done) is PullDone
    assert decoded_done == done


def test_decode_accepts_memoryview_and_bytearray() -> None:
    buf = CODEC.encode(PullDone(request_id="x"))
    assert CODEC.decode(memoryview(buf)) == PullDone(request_id="x")
    assert CODEC.decode(bytearray(buf)) == PullDone(request_id="x")


@settings(max_examples=50, deadline=None)
@given(
    request_id=st.text(max_size=40),
    block_ids=st.lists(st.integers(min_value=0, max_value=2**40), max_size=64).map(tuple),
    tp_rank=st.integers(min_value=0, max_value=1024),
)
def test_round_trip_property(request_id: str, block_ids: tuple[int, ...], tp_rank: int) -> None:
    msg = PullRequest(request_id=request_id, block_ids=block_ids, tp_rank=tp_rank)
    assert CODEC.decode(CODEC.encode(msg)) == msg


def test_wrong_type_raises_protocol_error_naming_type_and_size() -> None:
    buf = msgspec.msgpack.encode({"kind": "pull", "request_id": 7, "block_ids": [1]})
    with pytest.raises(ProtocolError) as info:
        CODEC.decode(buf)
    text = str(info.value)
    assert "PullRequest | PullDone" in text
    assert f"{len(buf)} bytes" in text
    assert isinstance(info.value.__cause__, msgspec.ValidationError)
    assert not isinstance(info.value, MessageTooLarge)


def test_unknown_tag_is_a_protocol_error() -> None:
    buf = msgspec.msgpack.encode({"kind": "explode", "request_id": "r"})
    with pytest.raises(ProtocolError, match="PullRequest"):
        CODEC.decode(buf)


def test_message_of_another_struct_is_refused() -> None:
    buf = Codec(Point).encode(Point(x=1, y=2))
    with pytest.raises(ProtocolError):
        CODEC.decode(buf)


def test_garbage_bytes_raise_protocol_error_showing_only_a_prefix() -> None:
    garbage = b"\xc1" + b"\xab" * 200
    with pytest.raises(ProtocolError) as info:
        CODEC.decode(garbage)
    assert isinstance(info.value.__cause__, msgspec.DecodeError)
    text = str(info.value)
    assert "201 bytes" in text
    assert garbage[:16].hex() in text
    assert garbage[:17].hex() not in text  # never more than a short prefix


def test_empty_buffer_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="0 bytes"):
        CODEC.decode(b"")


def test_oversize_frame_is_refused_before_decoding() -> None:
    codec = Codec(Point, max_bytes=64)
    # Garbage over the bound: a size error, not a decode error, so nothing was decoded.
    with pytest.raises(MessageTooLarge) as info:
        codec.decode(b"\xc1" * 65)
    assert "65 bytes" in str(info.value)
    assert "max_bytes=64" in str(info.value)
    assert info.value.__cause__ is None
    with pytest.raises(MessageTooLarge):
        codec.decode(memoryview(b"\x00" * 100))
    # Exactly at the bound is fine.
    at_bound = Codec(PointV2).encode(PointV2(x=1, y=2, label="a" * 30))
    assert Codec(PointV2, max_bytes=len(at_bound)).decode(at_bound).label == "a" * 30


def test_encode_refuses_a_message_the_peer_would_drop() -> None:
    codec = Codec(PullRequest, max_bytes=32)
    with pytest.raises(MessageTooLarge, match="max_bytes=32"):
        codec.encode(PullRequest(request_id="r", block_ids=tuple(range(100))))


def test_new_field_with_default_decodes_old_messages() -> None:
    old = Codec(Point).encode(Point(x=1, y=2))
    assert Codec(PointV2).decode(old) == PointV2(x=1, y=2, label="none")


def test_unknown_fields_from_a_newer_peer_are_ignored() -> None:
    new = Codec(PointV2).encode(PointV2(x=1, y=2, label="extra"))
    assert Codec(Point).decode(new) == Point(x=1, y=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "16"])
def test_bad_max_bytes_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        Codec(Point, max_bytes=bad)  # type: ignore[arg-type]


def test_untagged_struct_union_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="type_"):
        Codec(Point | PointV2)


def test_repr_names_the_type() -> None:
    assert repr(CODEC) == f"Codec(PullRequest | PullDone, max_bytes={DEFAULT_MAX_MESSAGE_BYTES})"
