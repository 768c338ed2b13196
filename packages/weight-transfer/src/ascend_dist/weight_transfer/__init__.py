"""ascend_dist.weight_transfer: trainer-to-inference weight sync for RL (broadcast and same-chip IPC).

Importing this package imports only the error types; the engines live in their modules
(`trainer`, `worker`, `ipc_trainer`, `ipc_worker`), the vLLM adapters in `vllm_engine`.
"""

from ascend_dist.weight_transfer.errors import (
    ManifestMismatch,
    ManifestRejected,
    UpdateAborted,
    UpdateStateError,
    WorkerLost,
)

__all__ = ["ManifestMismatch", "ManifestRejected", "UpdateAborted", "UpdateStateError", "WorkerLost"]
