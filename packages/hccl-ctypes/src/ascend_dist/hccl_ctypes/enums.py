"""ABI enumerations of HCCL (CANN ``hccl_types.h``) and NCCL (``nccl.h``) as plain `enum.IntEnum`s.

Runs in: any process; imports nothing but the standard library (no torch).

The values are ABI: they are passed unchanged to the native library, so they must match the
headers exactly (`hccl_types.h`, `nccl.h`). The torch → enum mapping lives in
`ascend_dist.hccl_ctypes.torch_compat`, which imports torch lazily.
"""

from __future__ import annotations

import enum

__all__ = [
    "HcclDataType",
    "HcclReduceOp",
    "HcclResult",
    "NcclDataType",
    "NcclRedOp",
    "NcclResult",
    "hcclDataTypeEnum",
    "hcclRedOpTypeEnum",
]


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
    # Upstream pyhccl_wrapper's names of the same codes (aliases: not listed when iterating).
    hcclInt8 = 0  # noqa: N815
    hcclInt16 = 1  # noqa: N815
    hcclInt32 = 2  # noqa: N815
    hcclFloat16 = 3  # noqa: N815
    hcclFloat32 = 4  # noqa: N815
    hcclInt64 = 5  # noqa: N815
    hcclUint64 = 6  # noqa: N815
    hcclUint8 = 7  # noqa: N815
    hcclUint16 = 8  # noqa: N815
    hcclUint32 = 9  # noqa: N815
    hcclFloat64 = 10  # noqa: N815
    hcclBfloat16 = 11  # noqa: N815
    hcclInt128 = 12  # noqa: N815

    @classmethod
    def from_torch(cls, dtype: object) -> HcclDataType:
        """The code of a torch dtype (upstream's name; torch is imported only by the caller).

        Raises:
            UnsupportedDtype: (a ``ValueError``) no HCCL code, e.g. ``torch.bool``.
        """
        from ascend_dist.hccl_ctypes.dialects import HCCL  # dialects imports this module
        from ascend_dist.hccl_ctypes.torch_compat import dtype_code

        return cls(dtype_code(HCCL, dtype))  # type: ignore[arg-type]


class HcclReduceOp(enum.IntEnum):
    """``HcclReduceOp`` codes."""

    SUM = 0
    PROD = 1
    MAX = 2
    MIN = 3
    # upstream pyhccl_wrapper's names (aliases)
    hcclSum = 0  # noqa: N815
    hcclProd = 1  # noqa: N815
    hcclMax = 2  # noqa: N815
    hcclMin = 3  # noqa: N815

    @classmethod
    def from_torch(cls, op: object) -> HcclReduceOp:
        """The code of a ``torch.distributed.ReduceOp`` (upstream's name).

        Raises:
            UnsupportedOp: (a ``ValueError``) any other op, e.g. ``AVG``.
        """
        from ascend_dist.hccl_ctypes.dialects import HCCL  # dialects imports this module
        from ascend_dist.hccl_ctypes.torch_compat import op_code

        return cls(op_code(HCCL, op))


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


# Upstream vllm-ascend ``pyhccl_wrapper``'s class names, for code written against that binding.
hcclDataTypeEnum = HcclDataType  # noqa: N816
hcclRedOpTypeEnum = HcclReduceOp  # noqa: N816
