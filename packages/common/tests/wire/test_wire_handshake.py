"""Handshake: canonical compat fields, deterministic hash, and mismatches that name the field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError, IncompatiblePeer, ProtocolError
from ascend_dist.common.wire import (
    Codec,
    Handshake,
    check_compatible,
    compat_fields,
    compat_hash,
    make_handshake,
)

FIELDS = {"model": "qwen3-8b", "dtype": "bfloat16", "block_size": 128, "tp": 8, "use_mla": False}


def _hello(version: int = 1, **overrides: object) -> Handshake:
    fields = {**FIELDS, **overrides}
    return make_handshake("kv-mooncake/pull", version, sender="engine-0", **fields)  # type: ignore[arg-type]


def test_compat_fields_are_canonical_strings_in_sorted_order() -> None:
    fields = compat_fields(tp=8, dtype="bfloat16", ratio=0.5, mla=True, shape=(2, (3, "a")), name="x")
    assert list(fields) == ["dtype", "mla", "name", "ratio", "shape", "tp"]
    assert fields == {
        "dtype": "bfloat16",
        "mla": "true",
        "name": "x",
        "ratio": "0.5",
        "shape": '[2,[3,"a"]]',
        "tp": "8",
    }


def test_bool_and_int_are_not_confused() -> None:
    assert compat_fields(flag=True) != compat_fields(flag=1)


@pytest.mark.parametrize("bad", [None, [1, 2], {"a": 1}, b"raw", (1, None)])
def test_unsupported_compat_value_names_the_field(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        compat_fields(layout=bad)  # type: ignore[arg-type]
    assert info.value.field == "layout"


def test_compat_hash_needs_canonical_strings() -> None:
    with pytest.raises(ConfigError) as info:
        compat_hash({"tp": 8})  # type: ignore[dict-item]
    assert info.value.field == "tp"


def test_hash_is_hex_sha256_and_order_independent() -> None:
    a = compat_hash({"a": "1", "b": "2"})
    assert len(a) == 64
    int(a, 16)
    assert a == compat_hash({"b": "2", "a": "1"})
    assert a != compat_hash({"a": "1", "b": "3"})
    # Length-unambiguous: moving characters between key and value changes the hash.
    assert compat_hash({"ab": "c"}) != compat_hash({"a": "bc"})


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=6))
def test_hash_ignores_insertion_order(fields: dict[str, str]) -> None:
    reordered = dict(reversed(list(fields.items())))
    assert compat_hash(fields) == compat_hash(reordered)


_CHILD = (
    "from ascend_dist.common.wire import make_handshake;"
    "print(make_handshake('kv-mooncake/pull', 1, model='qwen3-8b', dtype='bfloat16',"
    " block_size=128, tp=8, use_mla=False, shape=(1, 2)).compat_hash)"
)


def test_hash_is_deterministic_across_processes() -> None:
    hashes = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=30, check=True
        )
        hashes.add(out.stdout.strip())
    local = make_handshake(
        "kv-mooncake/pull",
        1,
        model="qwen3-8b",
        dtype="bfloat16",
        block_size=128,
        tp=8,
        use_mla=False,
        shape=(1, 2),
    )
    assert hashes == {local.compat_hash}


def test_make_handshake_fills_every_field() -> None:
    hello = _hello()
    assert hello.protocol == "kv-mooncake/pull"
    assert hello.protocol_version == 1
    assert hello.sender == "engine-0"
    assert hello.compat_fields == compat_fields(**FIELDS)  # type: ignore[arg-type]
    assert hello.compat_hash == compat_hash(hello.compat_fields)


@pytest.mark.parametrize(("protocol", "version"), [("", 1), ("p", -1), ("p", True), (3, 1)])
def test_make_handshake_validates_protocol_and_version(protocol: object, version: object) -> None:
    with pytest.raises(ConfigError):
        make_handshake(protocol, version)  # type: ignore[arg-type]


def test_compatible_peers_pass_even_with_different_senders() -> None:
    local = _hello()
    remote = make_handshake("kv-mooncake/pull", 1, sender="engine-9", **FIELDS)  # type: ignore[arg-type]
    check_compatible(local, remote)


def test_handshake_survives_the_wire() -> None:
    codec = Codec(Handshake)
    hello = _hello()
    received = codec.decode(codec.encode(hello))
    assert received == hello
    check_compatible(hello, received)


def _refusal(local: Handshake, remote: Handshake) -> IncompatiblePeer:
    with pytest.raises(IncompatiblePeer) as info:
        check_compatible(local, remote)
    assert isinstance(info.value, ProtocolError)
    return info.value


def test_protocol_mismatch_is_named_first() -> None:
    other = make_handshake("kv-mooncake/layerwise", 2, dtype="float16")
    err = _refusal(_hello(), other)
    assert (err.field, err.local, err.remote) == ("protocol", "kv-mooncake/pull", "kv-mooncake/layerwise")


def test_version_mismatch_is_named_before_fields() -> None:
    err = _refusal(_hello(version=1), _hello(version=2, dtype="float16"))
    assert (err.field, err.local, err.remote) == ("protocol_version", 1, 2)
    assert "protocol_version differs" in str(err)


def test_differing_compat_field_is_named_with_both_values() -> None:
    err = _refusal(_hello(), _hello(dtype="float16"))
    assert (err.field, err.local, err.remote) == ("dtype", "bfloat16", "float16")
    assert "dtype" in str(err)
    assert "bfloat16" in str(err)


def test_first_difference_in_sorted_order_is_named() -> None:
    err = _refusal(_hello(), _hello(tp=4, block_size=64))
    assert (err.field, err.local, err.remote) == ("block_size", "128", "64")


def test_field_missing_on_one_side_is_a_difference() -> None:
    fewer = {k: v for k, v in FIELDS.items() if k != "model"}
    remote = make_handshake("kv-mooncake/pull", 1, **fewer)  # type: ignore[arg-type]
    err = _refusal(_hello(), remote)
    assert (err.field, err.local, err.remote) == ("model", "qwen3-8b", None)
    extra = make_handshake("kv-mooncake/pull", 1, pp=2, **FIELDS)  # type: ignore[arg-type]
    err = _refusal(_hello(), extra)
    assert (err.field, err.local, err.remote) == ("pp", None, "2")


def test_hash_mismatch_with_equal_fields_names_compat_hash() -> None:
    local = _hello()
    forged = Handshake(
        protocol=local.protocol,
        protocol_version=local.protocol_version,
        compat_hash="0" * 64,
        compat_fields=dict(local.compat_fields),
    )
    err = _refusal(local, forged)
    assert err.field == "compat_hash"
