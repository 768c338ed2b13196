"""ascend_dist.hccl_ctypes: a ctypes binding of HCCL (and NCCL) and a communicator built on it.

Importing this package needs neither torch nor the native library: it exposes the binding
(`CollectiveLibrary` with the `HCCL` and `NCCL` dialects, `HCCLLibrary`), the ABI enums and the
errors. `PyHcclCommunicator` (defined in ``ascend_dist.hccl_ctypes.communicator``, imports torch) is
also reachable here as ``ascend_dist.hccl_ctypes.PyHcclCommunicator``: loaded lazily on first
access, so importing the package still imports no torch. The vLLM device communicator
(``ascend_dist.hccl_ctypes.vllm_communicator``, imports vLLM) is imported from its own module.
"""

from typing import TYPE_CHECKING

from ascend_dist.hccl_ctypes._lib import CollectiveLibrary, HCCLLibrary, NCCLLibrary, resolve_library_path
from ascend_dist.hccl_ctypes.dialects import (
    HCCL,
    HCCL_ROOT_INFO_BYTES,
    NCCL,
    NCCL_UNIQUE_ID_BYTES,
    Dialect,
    Function,
    Role,
    aclrtStream_t,
    buffer_type,
    hcclComm_t,
    hcclDataType_t,
    hcclRedOp_t,
    hcclResult_t,
    hcclUniqueId,
    ncclUniqueId,
)
from ascend_dist.hccl_ctypes.enums import (
    HcclDataType,
    HcclReduceOp,
    HcclResult,
    NcclDataType,
    NcclRedOp,
    NcclResult,
    hcclDataTypeEnum,
    hcclRedOpTypeEnum,
)
from ascend_dist.hccl_ctypes.errors import (
    CollectiveError,
    CommunicatorClosed,
    CommunicatorUnavailable,
    HcclError,
    LibraryLoadError,
    NcclError,
    SymbolNotExported,
    UnsupportedDtype,
    UnsupportedOp,
)

if TYPE_CHECKING:
    from ascend_dist.hccl_ctypes.communicator import PyHcclCommunicator

__all__ = [
    "HCCL",
    "HCCL_ROOT_INFO_BYTES",
    "NCCL",
    "NCCL_UNIQUE_ID_BYTES",
    "CollectiveError",
    "CollectiveLibrary",
    "CommunicatorClosed",
    "CommunicatorUnavailable",
    "Dialect",
    "Function",
    "HCCLLibrary",
    "HcclDataType",
    "HcclError",
    "HcclReduceOp",
    "HcclResult",
    "LibraryLoadError",
    "NCCLLibrary",
    "NcclDataType",
    "NcclError",
    "NcclRedOp",
    "NcclResult",
    "PyHcclCommunicator",
    "Role",
    "SymbolNotExported",
    "UnsupportedDtype",
    "UnsupportedOp",
    "aclrtStream_t",
    "buffer_type",
    "hcclComm_t",
    "hcclDataTypeEnum",
    "hcclDataType_t",
    "hcclRedOpTypeEnum",
    "hcclRedOp_t",
    "hcclResult_t",
    "hcclUniqueId",
    "ncclUniqueId",
    "resolve_library_path",
]


def __getattr__(name: str) -> object:
    """Load `PyHcclCommunicator` (and torch with it) on first access only."""
    if name == "PyHcclCommunicator":
        from ascend_dist.hccl_ctypes.communicator import PyHcclCommunicator

        return PyHcclCommunicator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
