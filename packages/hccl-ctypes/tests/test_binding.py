"""The ctypes binding on its own: ABI tables, loading, errors, marshalling against the fake library."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ascend_dist.common.errors import ConfigError
from ascend_dist.hccl_ctypes import (
    HCCL,
    NCCL,
    CollectiveLibrary,
    Function,
    HcclDataType,
    HcclError,
    HCCLLibrary,
    HcclReduceOp,
    HcclResult,
    LibraryLoadError,
    NcclDataType,
    NcclError,
    NCCLLibrary,
    NcclRedOp,
    Role,
    SymbolNotExported,
    UnsupportedDtype,
    UnsupportedOp,
    hcclDataTypeEnum,
    hcclRedOpTypeEnum,
    hcclUniqueId,
    ncclUniqueId,
    resolve_library_path,
)
from ascend_dist.hccl_ctypes.torch_compat import dtype_code, op_code


def test_import_needs_neither_torch_nor_the_library() -> None:
    code = "import sys, ascend_dist.hccl_ctypes as h; h.HCCL; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_communicator_is_exported_lazily_from_the_package() -> None:
    import ascend_dist.hccl_ctypes as package
    from ascend_dist.hccl_ctypes.communicator import PyHcclCommunicator

    assert package.PyHcclCommunicator is PyHcclCommunicator and "PyHcclCommunicator" in package.__all__
    with pytest.raises(AttributeError, match="NoSuchThing"):
        package.NoSuchThing  # noqa: B018


def test_enum_values_are_the_abi() -> None:
    assert [(m.name, m.value) for m in HcclDataType] == [
        ("INT8", 0), ("INT16", 1), ("INT32", 2), ("FP16", 3), ("FP32", 4), ("INT64", 5), ("UINT64", 6),
        ("UINT8", 7), ("UINT16", 8), ("UINT32", 9), ("FP64", 10), ("BFP16", 11), ("INT128", 12),
    ]  # fmt: skip
    assert [(m.name, m.value) for m in HcclReduceOp] == [("SUM", 0), ("PROD", 1), ("MAX", 2), ("MIN", 3)]
    assert HcclResult.E_TCP_CONNECT == 11 and HcclResult.E_SUSPENDING == 22 and len(HcclResult) == 23
    assert [(m.name, m.value) for m in NcclDataType][:10] == [
        ("INT8", 0), ("UINT8", 1), ("INT32", 2), ("UINT32", 3), ("INT64", 4), ("UINT64", 5), ("FLOAT16", 6),
        ("FLOAT32", 7), ("FLOAT64", 8), ("BFLOAT16", 9),
    ]  # fmt: skip
    assert NcclDataType.FLOAT8E4M3 == 10 and NcclRedOp.AVG == 4


def test_id_structures_and_function_record() -> None:
    uid = hcclUniqueId()
    assert len(uid.internal) == 4108 and ctypes.sizeof(uid) == 4108
    uid.internal[0] = -3
    assert uid.internal[0] == -3
    assert ctypes.sizeof(ncclUniqueId) == 128
    f = Function("HcclBroadcast", ctypes.c_int, [ctypes.c_void_p])
    assert (f.name, f.restype, f.argtypes, f.optional) == ("HcclBroadcast", ctypes.c_int, [ctypes.c_void_p], False)


def test_torch_dtype_and_op_mapping() -> None:
    expected = {
        torch.int8: 0, torch.uint8: 7, torch.int32: 2, torch.int64: 5, torch.float16: 3,
        torch.float32: 4, torch.float64: 10, torch.bfloat16: 11, torch.int16: 1,
    }  # fmt: skip
    assert {d: dtype_code(HCCL, d) for d in expected} == expected
    assert dtype_code(NCCL, torch.bfloat16) == 9 and dtype_code(NCCL, torch.float32) == 7
    for bad in (torch.complex64, torch.bool):
        with pytest.raises(UnsupportedDtype, match="dtype=torch"):
            dtype_code(HCCL, bad)
    with pytest.raises(ValueError, match="NOT_EXIST"):  # UnsupportedOp is a ValueError too
        op_code(HCCL, "NOT_EXIST")
    ops = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MAX, dist.ReduceOp.MIN)
    assert [op_code(HCCL, o) for o in ops] == [0, 1, 2, 3]
    with pytest.raises(UnsupportedOp):
        op_code(HCCL, dist.ReduceOp.AVG)
    assert op_code(NCCL, dist.ReduceOp.AVG) == 4


def test_missing_library_names_path_and_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LibraryLoadError, match=r"'/nonexistent/libhccl.so'.*set HCCL_SO_PATH") as info:
        HCCLLibrary("/nonexistent/libhccl.so")
    assert isinstance(info.value, OSError)
    monkeypatch.setenv("VLLM_NCCL_SO_PATH", "/nonexistent/libnccl.so.2")
    assert resolve_library_path(NCCL) == "/nonexistent/libnccl.so.2"
    with pytest.raises(LibraryLoadError, match="VLLM_NCCL_SO_PATH"):
        NCCLLibrary()
    monkeypatch.delenv("HCCL_SO_PATH", raising=False)
    assert resolve_library_path(HCCL) == "libhccl.so"


def test_wrong_dialect_lacks_required_symbol(fake_hccl: str) -> None:
    with pytest.raises(LibraryLoadError, match="missing symbol ncclGetErrorString"):
        NCCLLibrary(fake_hccl)


def test_loaded_once_per_path_and_errors_carry_the_library_string(fake_hccl: str) -> None:
    a, b = HCCLLibrary(fake_hccl), CollectiveLibrary(HCCL, fake_hccl)
    assert a._funcs is b._funcs
    assert CollectiveLibrary.path_to_library_cache[fake_hccl] is not None
    with pytest.raises(HcclError, match="HcclAllReduce failed with code 9: E_TIMEOUT") as info:
        a.check("HcclAllReduce", 9)
    assert (info.value.func, info.value.code) == ("HcclAllReduce", 9)
    a.check("x", ctypes.c_int(0))  # a ctypes zero is success, not "not equal to 0"
    with pytest.raises(HcclError, match="code 123: unknown error code"):
        a.check("HcclBroadcast", ctypes.c_int(123))
    assert not a.has(Role.ABORT) and a.has(Role.SEND)
    with pytest.raises(SymbolNotExported):
        a.comm_abort(None)


def test_hccl_check_raises_upstreams_message_as_a_typed_runtime_error(fake_hccl: str) -> None:
    lib = HCCLLibrary(fake_hccl)
    lib.HCCL_CHECK(0)
    lib.HCCL_CHECK(ctypes.c_int(0))
    with pytest.raises(RuntimeError, match=r"^HCCL error: E_TIMEOUT") as info:  # upstream: "HCCL error: <string>"
        lib.HCCL_CHECK(9)
    assert isinstance(info.value, HcclError)
    assert (info.value.func, info.value.code) == ("HCCL_CHECK", 9)
    with pytest.raises(HcclError, match=r"^HCCL error: unknown error code"):
        lib.HCCL_CHECK(ctypes.c_int(123))


def test_upstream_enum_names_and_from_torch() -> None:
    """vllm-ascend's ``hcclDataTypeEnum`` / ``hcclRedOpTypeEnum``: same codes, ``from_torch``, ValueError."""
    assert hcclDataTypeEnum.from_torch(torch.float32) == hcclDataTypeEnum.hcclFloat32 == HcclDataType.FP32 == 4
    assert hcclDataTypeEnum.from_torch(torch.bfloat16) == hcclDataTypeEnum.hcclBfloat16 == 11
    assert hcclDataTypeEnum.from_torch(torch.uint8) == hcclDataTypeEnum.hcclUint8 == 7
    assert hcclDataTypeEnum.from_torch(torch.int64) == 5 and hcclDataTypeEnum.from_torch(torch.float16) == 3
    assert hcclRedOpTypeEnum.from_torch(dist.ReduceOp.SUM) == hcclRedOpTypeEnum.hcclSum == 0
    assert hcclRedOpTypeEnum.from_torch(dist.ReduceOp.PRODUCT) == hcclRedOpTypeEnum.hcclProd == 1
    assert hcclRedOpTypeEnum.from_torch(dist.ReduceOp.MIN) == 3
    assert len(list(HcclDataType)) == 13 and len(list(HcclReduceOp)) == 4  # the aliases add no members
    with pytest.raises(ValueError, match=r"dtype=torch\.bool"):
        hcclDataTypeEnum.from_torch(torch.bool)
    with pytest.raises(ValueError, match="op="):
        hcclRedOpTypeEnum.from_torch(dist.ReduceOp.AVG)


def test_single_rank_communicator_through_the_binding(fake_hccl: str) -> None:
    lib = HCCLLibrary(fake_hccl)
    uid = lib.hcclGetUniqueId()
    with pytest.raises(ConfigError, match="rank=1"):
        lib.comm_init_rank(1, uid, 1)
    with pytest.raises(ConfigError, match="world_size=0"):
        lib.comm_init_rank(0, uid, 0)
    with pytest.raises(ConfigError, match="unique_id"):
        lib.comm_init_rank(1, ncclUniqueId(), 0)
    with pytest.raises(ConfigError, match="exactly 4108 bytes"):
        lib.unique_id_from_bytes(b"\0" * 128)
    comm = lib.hcclCommInitRank(1, lib.unique_id_from_bytes(bytes(uid)), 0)
    x = torch.arange(10, dtype=torch.float32)
    y = torch.empty_like(x)
    lib.all_reduce(x.data_ptr(), y.data_ptr(), x.numel(), HcclDataType.FP32, HcclReduceOp.SUM, comm, None)
    assert torch.equal(x, y)
    for count in (-1, 2**64):
        with pytest.raises(ConfigError, match="count"):
            lib.all_reduce(x.data_ptr(), y.data_ptr(), count, 4, 0, comm, None)
    with pytest.raises(UnsupportedOp, match="op=7"):
        lib.all_reduce(x.data_ptr(), y.data_ptr(), 1, 4, 7, comm, None)
    with pytest.raises(HcclError, match="E_PARA"):  # the library itself rejects a root outside the group
        lib.broadcast(x.data_ptr(), 10, 4, 3, comm, None)
    with pytest.raises(HcclError, match="E_PTR"):
        lib.all_reduce(0, y.data_ptr(), 10, 4, 0, comm, None)
    lib.hcclCommDestroy(comm)
    with pytest.raises(HcclError, match="code 2"):
        lib.hcclCommDestroy(comm)


def test_scripted_failure_returns_its_code(fake_hccl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = HCCLLibrary(fake_hccl)
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclGetRootInfo:7")
    with pytest.raises(HcclError, match="HcclGetRootInfo failed with code 7: E_UNAVAIL"):
        lib.get_unique_id()


def test_nccl_dialect_marshalling_against_an_nccl_abi_library(fake_nccl: str) -> None:
    lib = NCCLLibrary(fake_nccl)
    assert lib.has(Role.ABORT) and lib.has(Role.SEND)
    uid = lib.get_unique_id()
    assert ctypes.sizeof(uid) == 128
    with pytest.raises(NcclError, match="ncclCommInitRank failed with code 4: invalid argument"):
        lib.comm_init_rank(1, lib.unique_id_from_bytes(b"\0" * 128), 0)  # the library checks the id's bytes
    comm = lib.comm_init_rank(1, lib.unique_id_from_bytes(bytes(uid)), 0)  # id by value, handle first
    for dtype in (torch.bfloat16, torch.float64, torch.uint8, torch.int64):
        x = (torch.arange(33) % 100).to(dtype)
        y = torch.zeros_like(x)
        lib.all_reduce(x.data_ptr(), y.data_ptr(), x.numel(), dtype_code(NCCL, dtype), NcclRedOp.AVG, comm, None)
        assert torch.equal(x, y), dtype  # the library copied numel * its own element size
    b = torch.arange(8, dtype=torch.float32)
    lib.broadcast(b.data_ptr(), 8, NcclDataType.FLOAT32, 0, comm, None)
    assert ctypes.CDLL(fake_nccl).fake_nccl_last_broadcast_in_place() == 1  # send and recv: the same pointer
    with pytest.raises(NcclError, match="ncclSend failed with code 5: invalid usage"):
        lib.send(b.data_ptr(), 8, NcclDataType.FLOAT32, 0, comm, None)
    lib.comm_abort(comm)
