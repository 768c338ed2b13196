"""Map torch dtypes and reduce ops to a dialect's ABI codes.

Runs in: processes that use torch tensors with the binding. torch is imported inside the functions,
so importing this module stays cheap.

HCCL maps exactly the eight dtypes upstream maps (int8, uint8, int32, int64, float16, float32,
float64, bfloat16) plus int16 (HCCL supports it); ``torch.bool`` is deliberately unsupported
(HCCL has no bool, and reducing bytes as uint8 would give a wrong OR). NCCL maps its own set.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ascend_dist.hccl_ctypes.dialects import Dialect
from ascend_dist.hccl_ctypes.enums import HcclDataType, HcclReduceOp, NcclDataType, NcclRedOp
from ascend_dist.hccl_ctypes.errors import UnsupportedDtype, UnsupportedOp

if TYPE_CHECKING:
    import torch

__all__ = ["dtype_code", "op_code", "supported_dtypes"]

_HCCL_DTYPES = {
    "int8": HcclDataType.INT8,
    "int16": HcclDataType.INT16,
    "uint8": HcclDataType.UINT8,
    "int32": HcclDataType.INT32,
    "int64": HcclDataType.INT64,
    "float16": HcclDataType.FP16,
    "float32": HcclDataType.FP32,
    "float64": HcclDataType.FP64,
    "bfloat16": HcclDataType.BFP16,
}
_NCCL_DTYPES = {
    "int8": NcclDataType.INT8,
    "uint8": NcclDataType.UINT8,
    "int32": NcclDataType.INT32,
    "int64": NcclDataType.INT64,
    "float16": NcclDataType.FLOAT16,
    "float32": NcclDataType.FLOAT32,
    "float64": NcclDataType.FLOAT64,
    "bfloat16": NcclDataType.BFLOAT16,
    "float8_e4m3fn": NcclDataType.FLOAT8E4M3,
    "float8_e5m2": NcclDataType.FLOAT8E5M2,
}
_HCCL_OPS = {"SUM": HcclReduceOp.SUM, "PRODUCT": HcclReduceOp.PROD, "MAX": HcclReduceOp.MAX, "MIN": HcclReduceOp.MIN}
_NCCL_OPS = {
    "SUM": NcclRedOp.SUM,
    "PRODUCT": NcclRedOp.PROD,
    "MAX": NcclRedOp.MAX,
    "MIN": NcclRedOp.MIN,
    "AVG": NcclRedOp.AVG,
}


def _dtypes(dialect: Dialect) -> dict[str, int]:
    return dict(_HCCL_DTYPES if dialect.name == "hccl" else _NCCL_DTYPES)


def supported_dtypes(dialect: Dialect) -> tuple[str, ...]:
    """Names of the torch dtypes the dialect maps (``"float32"``, ...)."""
    return tuple(_dtypes(dialect))


def dtype_code(dialect: Dialect, dtype: torch.dtype) -> int:
    """The dialect's data-type code of a torch dtype.

    Raises:
        UnsupportedDtype: The dtype has no code (e.g. ``torch.bool``, ``torch.complex64``).
    """
    name = str(dtype).removeprefix("torch.")
    table = _dtypes(dialect)
    if name not in table:
        raise UnsupportedDtype("dtype", dtype, f"one of {', '.join(table)} for {dialect.name}")
    return int(table[name])


def op_code(dialect: Dialect, op: object) -> int:
    """The dialect's reduce-op code of a ``torch.distributed.ReduceOp`` (or its name, e.g. ``"SUM"``).

    Raises:
        UnsupportedOp: Any other op (``AVG`` on HCCL, ``BAND``, a junk string).
    """
    table = _HCCL_OPS if dialect.name == "hccl" else _NCCL_OPS
    name = op if isinstance(op, str) else getattr(op, "name", None)
    if name is None:
        name = str(op).rsplit(".", 1)[-1]  # torch's RedOpType prints as "RedOpType.SUM"
    if name not in table:
        raise UnsupportedOp("op", op, f"one of {', '.join(table)} for {dialect.name}")
    return int(table[name])
