"""The device runtime: the one interface through which ascend_dist touches hardware.

Runs in: every process that moves tensor bytes (workers, tests).

`get_runtime` returns the process-wide runtime, created once from `select_backend`
(``ASCEND_DIST_DEVICE=npu|cuda|cpu``, else auto-detected); `create_runtime` builds one explicitly,
for tests. Importing this package does not import torch: the backends import it when first used
(`TorchDeviceRuntime` lives in ``ascend_dist.common.device.torch_backend``, which imports torch).

Typical use (every backend)::

    rt = get_runtime()
    stream = rt.new_stream()
    with rt.use_stream(stream):
        rt.batch_copy(src_ptrs, dst_ptrs, sizes, CopyDirection.D2H)
        done = stream.record_event()
    done.synchronize(timeout=5.0)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ascend_dist.common.device.base import (
    DEFAULT_TIMEOUT_S,
    MAX_DESCRIPTORS_PER_CALL,
    CopyDirection,
    DescriptorBatch,
    DeviceRuntime,
    Event,
    Stream,
    split_descriptors,
    validate_batch,
)
from ascend_dist.common.device.cpu_sim import CpuSimRuntime
from ascend_dist.common.device.detect import (
    BACKENDS,
    DEVICE_ENV,
    BackendChoice,
    BackendProbe,
    SystemProbe,
    select_backend,
)
from ascend_dist.common.device.ipc import (
    IPC_HANDLE_VERSION,
    IpcHandle,
    decode_ipc_handle,
    dtype_from_str,
    dtype_to_str,
    encode_ipc_handle,
)
from ascend_dist.common.errors import ConfigError, format_allowed

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "DEVICE_ENV",
    "IPC_HANDLE_VERSION",
    "MAX_DESCRIPTORS_PER_CALL",
    "BackendChoice",
    "BackendProbe",
    "CopyDirection",
    "CpuSimRuntime",
    "DescriptorBatch",
    "DeviceRuntime",
    "Event",
    "IpcHandle",
    "Stream",
    "SystemProbe",
    "close_runtime",
    "create_runtime",
    "decode_ipc_handle",
    "dtype_from_str",
    "dtype_to_str",
    "encode_ipc_handle",
    "get_runtime",
    "select_backend",
    "split_descriptors",
    "validate_batch",
]

logger = logging.getLogger(__name__)


class _ProcessRuntime:
    """The process-wide runtime slot, guarded by its lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runtime: DeviceRuntime | None = None


_PROCESS = _ProcessRuntime()


def create_runtime(name: str, **kwargs: Any) -> DeviceRuntime:  # kwargs are backend-specific options
    """Create a runtime of the named backend (explicit; tests use this).

    Args:
        name: ``"npu"``, ``"cuda"`` or ``"cpu"``.
        **kwargs: Passed to the backend: `CpuSimRuntime` options (``manual``,
            ``copy_latency_s``, ``wait_timeout_s``) or ``device_index`` for npu/cuda.

    Returns:
        A new runtime; the caller closes it.

    Raises:
        ConfigError: Unknown backend name or option.
        DeviceUnavailable: The hardware backend cannot be used here.
    """
    if name == "cpu":
        return CpuSimRuntime(**kwargs)
    if name in ("npu", "cuda"):
        from ascend_dist.common.device.torch_backend import TorchDeviceRuntime

        return TorchDeviceRuntime(name, **kwargs)
    raise ConfigError("name", name, format_allowed(BACKENDS))


def get_runtime() -> DeviceRuntime:
    """Return the process-wide runtime, creating it on first use (thread-safe).

    Returns:
        The runtime of the backend `select_backend` chose.

    Raises:
        ConfigError: ``ASCEND_DIST_DEVICE`` names an unknown backend.
        DeviceUnavailable: ``ASCEND_DIST_DEVICE`` names a backend that cannot be used here.
    """
    with _PROCESS.lock:
        if _PROCESS.runtime is None:
            choice = select_backend()
            logger.info("device backend %s: %s", choice.name, choice.reason)
            _PROCESS.runtime = create_runtime(choice.name)
        return _PROCESS.runtime


def close_runtime() -> None:
    """Close the process-wide runtime, if one was created; a later `get_runtime` makes a new one."""
    with _PROCESS.lock:
        runtime, _PROCESS.runtime = _PROCESS.runtime, None
    if runtime is not None:
        runtime.close()
