"""IPC handles: the msgpack codec and the CPU simulation's shared memory across processes."""

from __future__ import annotations

import multiprocessing

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.device import (
    IPC_HANDLE_VERSION,
    IpcHandle,
    decode_ipc_handle,
    dtype_from_str,
    dtype_to_str,
    encode_ipc_handle,
)
from ascend_dist.common.device.cpu_sim import CpuSimRuntime
from ascend_dist.common.device.ipc import DTYPE_NAMES, MAX_IPC_HANDLE_BYTES, strided_extent
from ascend_dist.common.errors import (
    ConfigError,
    DeviceError,
    IncompatiblePeer,
    MessageTooLarge,
    ProtocolError,
)


def _handle(**overrides: object) -> IpcHandle:
    fields: dict[str, object] = {
        "version": IPC_HANDLE_VERSION,
        "backend": "cpu",
        "payload": b"psm_abc",
        "offset": 16,
        "nbytes": 64,
        "dtype": "float32",
        "shape": (3, 4),
        "stride": (4, 1),
        "device_index": 0,
    }
    fields.update(overrides)
    return IpcHandle(**fields)  # type: ignore[arg-type]


# -- codec ----------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    fields=st.fixed_dictionaries(
        {
            "payload": st.binary(max_size=256),
            "offset": st.integers(0, 2**40),
            "nbytes": st.integers(0, 2**40),
            "dtype": st.sampled_from(DTYPE_NAMES),
            "device_index": st.integers(0, 15),
        }
    ),
    dims=st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 10**6)), max_size=6),
)
def test_codec_round_trip(fields: dict[str, object], dims: list[tuple[int, int]]) -> None:
    handle = _handle(**fields, shape=tuple(d[0] for d in dims), stride=tuple(d[1] for d in dims))
    assert decode_ipc_handle(encode_ipc_handle(handle)) == handle


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00", b"garbage", msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode({"version": 1})],
)
def test_decode_rejects_garbage(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="undecodable IPC handle"):
        decode_ipc_handle(data)


def test_decode_rejects_wrong_version() -> None:
    with pytest.raises(IncompatiblePeer, match="version") as info:
        decode_ipc_handle(encode_ipc_handle(_handle(version=IPC_HANDLE_VERSION + 1)))
    assert info.value.remote == IPC_HANDLE_VERSION + 1


def test_decode_rejects_oversize_input_without_decoding() -> None:
    data = encode_ipc_handle(_handle(payload=b"x" * MAX_IPC_HANDLE_BYTES))
    with pytest.raises(MessageTooLarge):
        decode_ipc_handle(data)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dtype": "float128"}, "dtype"),
        ({"shape": (3, 4), "stride": (1,)}, "differ in length"),
        ({"offset": -1}, "undecodable"),
        ({"nbytes": -5}, "undecodable"),
    ],
)
def test_decode_rejects_inconsistent_fields(overrides: dict[str, object], message: str) -> None:
    raw = msgspec.structs.asdict(_handle())
    raw.update(overrides)
    with pytest.raises(ProtocolError, match=message):
        decode_ipc_handle(msgspec.msgpack.encode(raw))


def test_handle_is_not_pickle() -> None:
    data = encode_ipc_handle(_handle())
    assert not data.startswith(b"\x80")  # pickle protocol 2+ marker
    assert msgspec.msgpack.decode(data)["backend"] == "cpu"


@pytest.mark.parametrize("name", ["bool", "uint8", "int32", "int64", "float16", "bfloat16", "float32"])
def test_dtype_names_round_trip(name: str) -> None:
    dtype = dtype_from_str(name)
    assert dtype == getattr(torch, name)
    assert dtype_to_str(dtype) == name


def test_dtype_unknown_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        dtype_from_str("float128")
    with pytest.raises(ConfigError, match="dtype"):
        dtype_to_str(torch.quint8)


def test_strided_extent() -> None:
    assert strided_extent((3, 4), (4, 1)) == 12
    assert strided_extent((4, 3), (1, 4)) == 12
    assert strided_extent((2, 2), (8, 1)) == 10
    assert strided_extent((0, 5), (5, 1)) == 0
    assert strided_extent((), ()) == 1


# -- CPU simulation shared memory ------------------------------------------------------------------


def test_open_in_same_process_shares_bytes() -> None:
    with CpuSimRuntime() as rt:
        shared = rt.empty_shared((4, 8), torch.int32)
        assert torch.count_nonzero(shared) == 0
        view = shared[1:3, 2:6]
        handle = decode_ipc_handle(encode_ipc_handle(rt.ipc_handle(view)))
        assert (handle.offset, handle.shape, handle.stride) == ((8 + 2) * 4, (2, 4), (8, 1))
        opened = rt.open_ipc_handle(handle)
        opened.copy_(torch.arange(8, dtype=torch.int32).view(2, 4))
        assert torch.equal(shared[1:3, 2:6], torch.arange(8, dtype=torch.int32).view(2, 4))
        assert int(shared.sum()) == sum(range(8))
        # a handle of an opened tensor names the same segment
        assert rt.ipc_handle(opened).payload == handle.payload


def test_ipc_handle_of_private_tensor_is_refused() -> None:
    with CpuSimRuntime() as rt:
        private = rt.empty((16,), torch.uint8)
        with pytest.raises(DeviceError, match="empty_shared"):
            rt.ipc_handle(private)


def test_open_refuses_foreign_backend_and_missing_segment() -> None:
    with CpuSimRuntime() as rt:
        with pytest.raises(DeviceError, match="backend 'cuda'"):
            rt.open_ipc_handle(_handle(backend="cuda"))
        with pytest.raises(DeviceError, match="no shared-memory segment"):
            rt.open_ipc_handle(_handle(payload=b"ascend_dist_no_such_segment"))
        with pytest.raises(ConfigError, match="segment name"):
            rt.open_ipc_handle(_handle(payload=b"../etc/passwd"))
        with pytest.raises(ProtocolError, match="does not fit"):
            rt.open_ipc_handle(_handle(offset=32, nbytes=64))


def test_segments_are_unlinked_on_close() -> None:
    rt = CpuSimRuntime()
    handle = rt.ipc_handle(rt.empty_shared((8,), torch.float32))
    rt.close()
    with CpuSimRuntime() as other, pytest.raises(DeviceError, match="no shared-memory segment"):
        other.open_ipc_handle(handle)


# Runs in the spawned child. The child cannot import this test module (pytest imports it by path),
# so it receives source text and runs it with the builtin exec.
_CHILD_FILL = """
from ascend_dist.common.device import decode_ipc_handle
from ascend_dist.common.device.cpu_sim import CpuSimRuntime

with CpuSimRuntime() as rt:
    rt.open_ipc_handle(decode_ipc_handle(handle_bytes)).fill_(value)
"""


def test_round_trip_across_spawned_process() -> None:
    with CpuSimRuntime() as rt:
        shared = rt.empty_shared((64, 16), torch.int64)
        target = shared[8:40:2]  # strided view: only every other row of the middle
        handle_bytes = encode_ipc_handle(rt.ipc_handle(target))
        ctx = multiprocessing.get_context("spawn")
        child = ctx.Process(target=exec, args=(_CHILD_FILL, {"handle_bytes": handle_bytes, "value": 7}))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        expected = torch.zeros(64, 16, dtype=torch.int64)
        expected[8:40:2] = 7
        assert torch.equal(shared, expected)
