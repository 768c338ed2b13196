"""Wire types: manifests, the first-difference check, IPC chunk codecs."""

from __future__ import annotations

import msgspec
import pytest

from ascend_dist.common.device.ipc import IPC_HANDLE_VERSION, IpcHandle
from ascend_dist.common.errors import ConfigError, IncompatiblePeer, ProtocolError
from ascend_dist.weight_transfer.errors import ManifestMismatch
from ascend_dist.weight_transfer.messages import (
    IpcChunk,
    Manifest,
    check_manifests,
    decode_ipc_chunk,
    decode_manifest,
    encode_ipc_chunk,
    encode_manifest,
    ipc_chunk_from_builtins,
    ipc_chunk_to_builtins,
    make_manifest,
)

BASE = [("w", "float32", (2, 3)), ("b", "bfloat16", (3,)), ("s", "int64", ())]


def test_manifest_codec_round_trip_and_digest() -> None:
    m = make_manifest(BASE, buffer_size_bytes=64, num_buffers=3)
    assert decode_manifest(encode_manifest(m)) == m
    assert m.digest() == make_manifest(BASE, buffer_size_bytes=64, num_buffers=3).digest()
    assert m.digest() != make_manifest(BASE, buffer_size_bytes=65, num_buffers=3).digest()


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (
            make_manifest([("w", "float32", (2, 4)), *BASE[1:]]),
            r"shape of tensor 'w': worker has \(2, 3\), trainer has \(2, 4\)",
        ),
        (
            make_manifest([("w", "float16", (2, 3)), *BASE[1:]]),
            r"dtype of tensor 'w': worker has 'float32', trainer has 'float16'",
        ),
        (make_manifest([("x", "float32", (2, 3)), *BASE[1:]]), r"name of tensor #0: worker has 'w', trainer has 'x'"),
        (
            make_manifest([*BASE, ("extra", "int8", (1,))]),
            r"tensor count \(first unmatched 'extra'\): worker has 3, trainer has 4",
        ),
        (
            make_manifest(BASE, buffer_size_bytes=4 << 30),
            r"buffer_size_bytes: worker has 1073741824, trainer has 4294967296",
        ),
        (make_manifest(BASE, num_buffers=3), r"num_buffers: worker has 2, trainer has 3"),
        (make_manifest(BASE, packed=False), r"packed: worker has True, trainer has False"),
        (
            make_manifest(BASE, direct_threshold_bytes=4096),
            r"direct_threshold_bytes: worker has 0, trainer has 4096",
        ),
    ],
)
def test_mismatch_names_the_first_difference(other: Manifest, message: str) -> None:
    with pytest.raises(ManifestMismatch, match=message):
        check_manifests(make_manifest(BASE), other, local_role="worker", remote_role="trainer")


def test_equal_manifests_pass() -> None:
    check_manifests(make_manifest(BASE), make_manifest(BASE), local_role="a", remote_role="b")


@pytest.mark.parametrize(
    ("specs", "field"),
    [([("w", "float24", (1,))], "dtype of 'w'"), ([("w", "float32", (-1,))], "shape of 'w'"),
     ([("w", "int8", ()), ("w", "int8", ())], "tensor name")],
)  # fmt: skip
def test_bad_specs_are_config_errors_naming_the_field(specs: list, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        make_manifest(specs)


def test_bad_geometry_is_refused() -> None:
    with pytest.raises(ConfigError, match="buffer_size_bytes"):
        make_manifest(BASE, buffer_size_bytes=0)
    with pytest.raises(ConfigError, match="num_buffers"):
        make_manifest(BASE, num_buffers=0)


def test_decode_refuses_garbage_and_other_versions() -> None:
    with pytest.raises(ProtocolError):
        decode_manifest(b"\x00garbage")
    newer = msgspec.structs.replace(make_manifest(BASE), version=99)
    with pytest.raises(IncompatiblePeer, match=r"Manifest\.version"):
        decode_manifest(encode_manifest(newer))


def _chunk() -> IpcChunk:
    handle = IpcHandle(version=IPC_HANDLE_VERSION, backend="cpu", payload=b"psm_x", offset=0, nbytes=32,
                       dtype="uint8", shape=(32,), stride=(1,), device_index=0)  # fmt: skip
    return IpcChunk(manifest=make_manifest(BASE), chunk_index=0, num_chunks=1, handles=({"h-cpu0": handle},))


def test_ipc_chunk_survives_json_and_msgpack() -> None:
    chunk = _chunk()
    as_json = msgspec.json.encode(ipc_chunk_to_builtins(chunk))  # what an HTTP control plane carries
    assert ipc_chunk_from_builtins(msgspec.json.decode(as_json)) == chunk
    assert decode_ipc_chunk(encode_ipc_chunk(chunk)) == chunk


def test_malformed_ipc_chunk_is_a_protocol_error() -> None:
    data = ipc_chunk_to_builtins(_chunk())
    data["chunk_index"] = -1
    with pytest.raises(ProtocolError):
        ipc_chunk_from_builtins(data)
