"""ABI enumerations of HCCL (CANN ``hccl_types.h``) and NCCL (``nccl.h``) as plain `enum.IntEnum`s.

Runs in: any process; imports nothing but the standard library (no torch).

The values are ABI: they are passed unchanged to the native library, so they must match the
headers exactly (`hccl_types.h`, `nccl.h`). The torch → enum mapping lives in
`ascend_dist.hccl_ctypes.torch_compat`, which imports torch lazily.
"""

from __future__ import annotations

import enum

__all__ = ["HcclDataType", "HcclReduceOp", "HcclResult", "NcclDataType", "NcclRedOp", "NcclResult"]


class HcclDataType(enum.IntEnum):
    """``HcclDataType`` codes."""

    INT8 = 0
    INT16 = 1
    INT32 = 2
    FP16 = 3
    FP32 = 4
    INT64 = 5
    UINT64 = 6
    UINT8 = 7
    UINT16 = 8
    UINT32 = 9
    FP64 = 10
    BFP16 = 11
    INT128 = 12


class HcclReduceOp(enum.IntEnum):
    """``HcclReduceOp`` codes."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3


class HcclResult(enum.IntEnum):
    """``HcclResult`` codes (0 is success); used to name a failure when the library's string is empty."""

    SUCCESS = 0
    E_PARA = 1
    E_PTR = 2
    E_MEMORY = 3
    E_INTERNAL = 4
    E_NOT_SUPPORT = 5
    E_NOT_FOUND = 6
    E_UNAVAIL = 7
    E_SYSCALL = 8
    E_TIMEOUT = 9
    E_OPEN_FILE_FAILURE = 10
    E_TCP_CONNECT = 11
    E_ROCE_CONNECT = 12
    E_TCP_TRANSFER = 13
    E_ROCE_TRANSFER = 14
    E_RUNTIME = 15
    E_DRV = 16
    E_PROFILING = 17
    E_CCE = 18
    E_NETWORK = 19
    E_AGAIN = 20
    E_REMOTE = 21
    E_SUSPENDING = 22


class NcclDataType(enum.IntEnum):
    """``ncclDataType_t`` codes."""

    INT8 = 0
    UINT8 = 1
    INT32 = 2
    UINT32 = 3
    INT64 = 4
    UINT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT8E4M3 = 10
    FLOAT8E5M2 = 11


class NcclRedOp(enum.IntEnum):
    """``ncclRedOp_t`` codes."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    AVG = 4


class NcclResult(enum.IntEnum):
    """``ncclResult_t`` codes (0 is success)."""

    SUCCESS = 0
    UNHANDLED_CUDA_ERROR = 1
    SYSTEM_ERROR = 2
    INTERNAL_ERROR = 3
    INVALID_ARGUMENT = 4
    INVALID_USAGE = 5
    REMOTE_ERROR = 6
    IN_PROGRESS = 7
