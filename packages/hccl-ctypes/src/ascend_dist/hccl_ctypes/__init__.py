"""ascend_dist.hccl_ctypes: a ctypes binding of HCCL (and NCCL) and a communicator built on it.

Importing this package needs neither torch nor the native library: it exposes the binding
(`CollectiveLibrary` with the `HCCL` and `NCCL` dialects, `HCCLLibrary`), the ABI enums and the
errors. `PyHcclCommunicator` (``ascend_dist.hccl_ctypes.communicator``, imports torch) and the vLLM
device communicator (``ascend_dist.hccl_ctypes.vllm_communicator``, imports vLLM) are imported from
their own modules.
"""

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
from ascend_dist.hccl_ctypes.enums import HcclDataType, HcclReduceOp, HcclResult, NcclDataType, NcclRedOp, NcclResult
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
    "Role",
    "SymbolNotExported",
    "UnsupportedDtype",
    "UnsupportedOp",
    "aclrtStream_t",
    "buffer_type",
    "hcclComm_t",
    "hcclDataType_t",
    "hcclRedOp_t",
    "hcclResult_t",
    "hcclUniqueId",
    "ncclUniqueId",
    "resolve_library_path",
]
