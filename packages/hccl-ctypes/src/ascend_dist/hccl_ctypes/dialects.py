"""The two dialects of the collective binding: HCCL (Ascend CANN) and NCCL (CUDA), as data.

Runs in: any process; imports only ctypes and the standard library (no torch, no library load).

Design rationale (why ctypes, why dialects): the communicator must work without torch.distributed
knowing the device's collective backend (an RL trainer plus vLLM workers are not one torch world),
be safe inside graph capture (a plain C call on a stream) and let an operator switch library builds
by an environment variable. HCCL and NCCL differ only in names, id size, argument order of the
init call, broadcast's buffers and enum values, so one binding
class (`ascend_dist.hccl_ctypes._lib.CollectiveLibrary`) is driven by a `Dialect` record:

| concern | HCCL | NCCL |
|---|---|---|
| library / env | ``libhccl.so`` / ``HCCL_SO_PATH`` | ``libnccl.so.2`` / ``VLLM_NCCL_SO_PATH`` |
| id | ``HcclRootInfo``, 4108 bytes, by pointer | ``ncclUniqueId``, 128 bytes, by value |
| comm init | ``(nRanks, id*, rank, comm*)`` handle last | ``(comm*, nRanks, id, rank)`` handle first |
| broadcast | in place ``(buf, count, dtype, root, comm, stream)`` | ``(send, recv, count, ...)`` |

Optional symbols (send, recv, all-gather, reduce-scatter, abort) are bound when the library exports
them; calling one it lacks raises `SymbolNotExported`.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from ascend_dist.hccl_ctypes.enums import HcclDataType, HcclReduceOp, NcclDataType, NcclRedOp
from ascend_dist.hccl_ctypes.errors import CollectiveError, HcclError, NcclError

__all__ = [
    "HCCL",
    "HCCL_ROOT_INFO_BYTES",
    "NCCL",
    "NCCL_UNIQUE_ID_BYTES",
    "Role",
    "Dialect",
    "Function",
    "aclrtStream_t",
    "buffer_type",
    "hcclComm_t",
    "hcclDataType_t",
    "hcclRedOp_t",
    "hcclResult_t",
    "hcclUniqueId",
    "ncclUniqueId",
]

# ctypes aliases (names kept from upstream pyhccl_wrapper; tests and callers import them).
hcclResult_t = ctypes.c_int  # noqa: N816
hcclComm_t = ctypes.c_void_p  # noqa: N816
aclrtStream_t = ctypes.c_void_p  # noqa: N816
buffer_type = ctypes.c_void_p
hcclDataType_t = ctypes.c_int  # noqa: N816
hcclRedOp_t = ctypes.c_int  # noqa: N816

HCCL_ROOT_INFO_BYTES: Final[int] = 4108
NCCL_UNIQUE_ID_BYTES: Final[int] = 128


class hcclUniqueId(ctypes.Structure):  # noqa: N801  (the upstream name; C's HcclRootInfo)
    """``HcclRootInfo``: 4108 opaque bytes created by the root rank and shared with every rank."""

    _fields_ = [("internal", ctypes.c_byte * HCCL_ROOT_INFO_BYTES)]


class ncclUniqueId(ctypes.Structure):  # noqa: N801  (the C name)
    """``ncclUniqueId``: 128 opaque bytes, passed to ``ncclCommInitRank`` by value."""

    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


@dataclass(frozen=True)
class Function:
    """One exported C function: its symbol, ctypes return type and argument types.

    ``optional`` symbols may be missing from the library (they are bound when present).
    """

    name: str
    restype: Any  # a ctypes type (ctypes has no common public base for them)
    argtypes: list[Any]
    optional: bool = False


_c = ctypes
_p = ctypes.POINTER

# --- HCCL (CANN hccl.h) ------------------------------------------------------------------------
_HCCL_FUNCTIONS: Final[tuple[Function, ...]] = (
    # const char *HcclGetErrorString(HcclResult code);
    Function("HcclGetErrorString", _c.c_char_p, [hcclResult_t]),
    # HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo);
    Function("HcclGetRootInfo", hcclResult_t, [_p(hcclUniqueId)]),
    # HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank, HcclComm *comm);
    Function("HcclCommInitRootInfo", hcclResult_t, [_c.c_uint32, _p(hcclUniqueId), _c.c_uint32, _p(hcclComm_t)]),
    # HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
    #                          HcclReduceOp op, HcclComm comm, aclrtStream stream);
    Function(
        "HcclAllReduce",
        hcclResult_t,
        [buffer_type, buffer_type, _c.c_uint64, hcclDataType_t, hcclRedOp_t, hcclComm_t, aclrtStream_t],
    ),
    # HcclResult HcclBroadcast(void *buf, uint64_t count, HcclDataType dataType, uint32_t root,
    #                          HcclComm comm, aclrtStream stream);
    Function(
        "HcclBroadcast",
        hcclResult_t,
        [buffer_type, _c.c_uint64, hcclDataType_t, _c.c_uint32, hcclComm_t, aclrtStream_t],
    ),
    # HcclResult HcclCommDestroy(HcclComm comm);   (not collective; must not race a running op)
    Function("HcclCommDestroy", hcclResult_t, [hcclComm_t]),
    # HcclResult HcclSend(void *sendBuf, uint64_t count, HcclDataType dataType, uint32_t destRank,
    #                     HcclComm comm, aclrtStream stream);
    Function(
        "HcclSend",
        hcclResult_t,
        [buffer_type, _c.c_uint64, hcclDataType_t, _c.c_uint32, hcclComm_t, aclrtStream_t],
        True,
    ),
    # HcclResult HcclRecv(void *recvBuf, uint64_t count, HcclDataType dataType, uint32_t srcRank,
    #                     HcclComm comm, aclrtStream stream);
    Function(
        "HcclRecv",
        hcclResult_t,
        [buffer_type, _c.c_uint64, hcclDataType_t, _c.c_uint32, hcclComm_t, aclrtStream_t],
        True,
    ),
    # HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, HcclDataType dataType,
    #                          HcclComm comm, aclrtStream stream);
    Function(
        "HcclAllGather",
        hcclResult_t,
        [buffer_type, buffer_type, _c.c_uint64, hcclDataType_t, hcclComm_t, aclrtStream_t],
        True,
    ),
    # HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount, HcclDataType dataType,
    #                              HcclReduceOp op, HcclComm comm, aclrtStream stream);
    Function(
        "HcclReduceScatter",
        hcclResult_t,
        [buffer_type, buffer_type, _c.c_uint64, hcclDataType_t, hcclRedOp_t, hcclComm_t, aclrtStream_t],
        True,
    ),
)

# --- NCCL (nccl.h) -------------------------------------------------------------------------------
ncclResult_t = ctypes.c_int  # noqa: N816
_NCCL_FUNCTIONS: Final[tuple[Function, ...]] = (
    # const char* ncclGetErrorString(ncclResult_t result);
    Function("ncclGetErrorString", _c.c_char_p, [ncclResult_t]),
    # ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
    Function("ncclGetUniqueId", ncclResult_t, [_p(ncclUniqueId)]),
    # ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
    Function("ncclCommInitRank", ncclResult_t, [_p(hcclComm_t), _c.c_int, ncclUniqueId, _c.c_int]),
    # ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    #                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    Function(
        "ncclAllReduce",
        ncclResult_t,
        [buffer_type, buffer_type, _c.c_size_t, _c.c_int, _c.c_int, hcclComm_t, _c.c_void_p],
    ),
    # ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
    #                            int root, ncclComm_t comm, cudaStream_t stream);
    Function(
        "ncclBroadcast",
        ncclResult_t,
        [buffer_type, buffer_type, _c.c_size_t, _c.c_int, _c.c_int, hcclComm_t, _c.c_void_p],
    ),
    # ncclResult_t ncclCommDestroy(ncclComm_t comm);
    Function("ncclCommDestroy", ncclResult_t, [hcclComm_t]),
    # ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
    #                       ncclComm_t comm, cudaStream_t stream);
    Function("ncclSend", ncclResult_t, [buffer_type, _c.c_size_t, _c.c_int, _c.c_int, hcclComm_t, _c.c_void_p], True),
    # ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
    #                       ncclComm_t comm, cudaStream_t stream);
    Function("ncclRecv", ncclResult_t, [buffer_type, _c.c_size_t, _c.c_int, _c.c_int, hcclComm_t, _c.c_void_p], True),
    # ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
    #                            ncclComm_t comm, cudaStream_t stream);
    Function(
        "ncclAllGather", ncclResult_t, [buffer_type, buffer_type, _c.c_size_t, _c.c_int, hcclComm_t, _c.c_void_p], True
    ),
    # ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
    #                                ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    Function(
        "ncclReduceScatter",
        ncclResult_t,
        [buffer_type, buffer_type, _c.c_size_t, _c.c_int, _c.c_int, hcclComm_t, _c.c_void_p],
        True,
    ),
    # ncclResult_t ncclCommAbort(ncclComm_t comm);
    Function("ncclCommAbort", ncclResult_t, [hcclComm_t], True),
)


class Role(enum.Enum):
    """What a symbol does, independent of its dialect's name for it."""

    ERROR_STRING = "error_string"
    UNIQUE_ID = "unique_id"
    COMM_INIT = "comm_init"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    DESTROY = "destroy"
    SEND = "send"
    RECV = "recv"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ABORT = "abort"


InitArgs = Callable[[int, ctypes.Structure, int, "ctypes._Pointer[hcclComm_t]"], tuple[Any, ...]]
BroadcastArgs = Callable[[int, int, int, int, int, int], tuple[Any, ...]]


def _hccl_init_args(
    world: int, uid: ctypes.Structure, rank: int, handle: ctypes._Pointer[hcclComm_t]
) -> tuple[Any, ...]:
    return (world, ctypes.byref(uid), rank, handle)


def _nccl_init_args(
    world: int, uid: ctypes.Structure, rank: int, handle: ctypes._Pointer[hcclComm_t]
) -> tuple[Any, ...]:
    return (handle, world, uid, rank)


def _hccl_broadcast_args(buf: int, count: int, dtype: int, root: int, comm: int, stream: int) -> tuple[Any, ...]:  # noqa: PLR0917
    return (buf, count, dtype, root, comm, stream)


def _nccl_broadcast_args(buf: int, count: int, dtype: int, root: int, comm: int, stream: int) -> tuple[Any, ...]:  # noqa: PLR0917
    return (buf, buf, count, dtype, root, comm, stream)  # in place: the same pointer twice, as vLLM does


@dataclass(frozen=True)
class Dialect:
    """Everything that differs between HCCL and NCCL, as data."""

    name: str
    default_library: str
    env_var: str
    id_type: type[ctypes.Structure]
    id_bytes: int
    functions: tuple[Function, ...]
    symbols: dict[Role, str | None]
    init_args: InitArgs
    broadcast_args: BroadcastArgs
    dtype_enum: type[enum.IntEnum]
    op_enum: type[enum.IntEnum]
    error_type: type[CollectiveError]
    count_bits: int
    rank_bits: int
    stream_attribute: str
    device_type: str

    def symbol(self, role: Role) -> str | None:
        """The C symbol playing ``role`` in this dialect (None: the dialect has no such call)."""
        return self.symbols.get(role)


HCCL: Final[Dialect] = Dialect(
    name="hccl",
    default_library="libhccl.so",
    env_var="HCCL_SO_PATH",
    id_type=hcclUniqueId,
    id_bytes=HCCL_ROOT_INFO_BYTES,
    functions=_HCCL_FUNCTIONS,
    symbols={
        Role.ERROR_STRING: "HcclGetErrorString",
        Role.UNIQUE_ID: "HcclGetRootInfo",
        Role.COMM_INIT: "HcclCommInitRootInfo",
        Role.ALL_REDUCE: "HcclAllReduce",
        Role.BROADCAST: "HcclBroadcast",
        Role.DESTROY: "HcclCommDestroy",
        Role.SEND: "HcclSend",
        Role.RECV: "HcclRecv",
        Role.ALL_GATHER: "HcclAllGather",
        Role.REDUCE_SCATTER: "HcclReduceScatter",
        Role.ABORT: None,  # HCCL has no abort; destroy is the only teardown
    },
    init_args=_hccl_init_args,
    broadcast_args=_hccl_broadcast_args,
    dtype_enum=HcclDataType,
    op_enum=HcclReduceOp,
    error_type=HcclError,
    count_bits=64,
    rank_bits=32,
    stream_attribute="npu_stream",
    device_type="npu",
)

NCCL: Final[Dialect] = Dialect(
    name="nccl",
    default_library="libnccl.so.2",
    env_var="VLLM_NCCL_SO_PATH",
    id_type=ncclUniqueId,
    id_bytes=NCCL_UNIQUE_ID_BYTES,
    functions=_NCCL_FUNCTIONS,
    symbols={
        Role.ERROR_STRING: "ncclGetErrorString",
        Role.UNIQUE_ID: "ncclGetUniqueId",
        Role.COMM_INIT: "ncclCommInitRank",
        Role.ALL_REDUCE: "ncclAllReduce",
        Role.BROADCAST: "ncclBroadcast",
        Role.DESTROY: "ncclCommDestroy",
        Role.SEND: "ncclSend",
        Role.RECV: "ncclRecv",
        Role.ALL_GATHER: "ncclAllGather",
        Role.REDUCE_SCATTER: "ncclReduceScatter",
        Role.ABORT: "ncclCommAbort",
    },
    init_args=_nccl_init_args,
    broadcast_args=_nccl_broadcast_args,
    dtype_enum=NcclDataType,
    op_enum=NcclRedOp,
    error_type=NcclError,
    count_bits=64,
    rank_bits=31,
    stream_attribute="cuda_stream",
    device_type="cuda",
)
