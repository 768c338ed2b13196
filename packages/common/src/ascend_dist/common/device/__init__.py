"""The device runtime: the one interface through which ascend_dist touches hardware.

Runs in: every process that moves tensor bytes (workers, tests).

`get_runtime` returns the process's runtime of a device (default: the current one), created once per
device index with the backend `select_backend` chose (``ASCEND_DIST_DEVICE=npu|cuda|cpu``, else
auto-detected); `create_runtime` builds one explicitly, for tests. Each rank of a multi-device node
thus enqueues on its own device: `current_device_index` follows torch's current device (vLLM's
worker sets it to the local rank) and, on the CPU simulation, `set_current_device`.
Importing this package does not import torch: the backends import it when first used
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
import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeAlias

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

if TYPE_CHECKING:
    import torch

DeviceSpec: TypeAlias = "int | str | torch.device | None"
"""Which device's runtime: an index, ``"npu:3"``, a ``torch.device``, or None for the current device."""

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
    "DeviceSpec",
    "Event",
    "IpcHandle",
    "Stream",
    "SystemProbe",
    "close_runtime",
    "create_runtime",
    "current_device_index",
    "decode_ipc_handle",
    "dtype_from_str",
    "dtype_to_str",
    "encode_ipc_handle",
    "get_runtime",
    "select_backend",
    "set_current_device",
    "tensors_runtime",
    "split_descriptors",
    "validate_batch",
]

logger = logging.getLogger(__name__)


class _ProcessRuntimes:
    """The process's runtimes, one per device index, and the CPU simulation's current device."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.backend: str | None = None  # chosen once, on first use
        self.runtimes: dict[int, DeviceRuntime] = {}
        self.sim_current = 0  # `set_current_device` on the cpu backend


_PROCESS = _ProcessRuntimes()


def _forget_after_fork() -> None:
    """In a forked child: the parent's runtimes have no stream threads here, so their ops would never run.

    Start over with none (nothing is closed: the parent owns their memory and shared segments); the
    lock is new too, as a parent thread may have held it at the fork.
    """
    _PROCESS.lock = threading.Lock()
    _PROCESS.runtimes = {}


os.register_at_fork(after_in_child=_forget_after_fork)


def create_runtime(name: str, **kwargs: Any) -> DeviceRuntime:  # kwargs are backend-specific options
    """Create a runtime of the named backend (explicit; tests use this).

    Args:
        name: ``"npu"``, ``"cuda"`` or ``"cpu"``.
        **kwargs: Passed to the backend: `CpuSimRuntime` options (``manual``,
            ``copy_latency_s``, ``wait_timeout_s``) or ``device_index`` (every backend).

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


def _backend_locked() -> str:
    if _PROCESS.backend is None:
        choice = select_backend()
        logger.info("device backend %s: %s", choice.name, choice.reason)
        _PROCESS.backend = choice.name
    return _PROCESS.backend


def _current_index_locked(backend: str) -> int:
    if backend == "cpu":
        return _PROCESS.sim_current
    from ascend_dist.common.device.torch_backend import current_device_index

    return current_device_index(backend)


def _requested_index(backend: str, device: DeviceSpec) -> int | None:
    """The device index ``device`` names on ``backend``; None: the current device."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise ConfigError("device", device, "a non-negative device index")
        return device
    kind = getattr(device, "type", None)
    index = getattr(device, "index", None)
    if isinstance(device, str):
        kind, _, text = device.partition(":")
        index = int(text) if text.isdigit() else None
        if text and index is None:
            raise ConfigError("device", device, f"'{backend}:<index>', 'cpu' or an index")
    if kind not in (backend, "cpu"):
        raise ConfigError("device", device, f"a {backend} device, 'cpu' or an index (the backend is {backend})")
    return index if isinstance(index, int) and index >= 0 else None


def get_runtime(device: DeviceSpec = None) -> DeviceRuntime:
    """Return this process's runtime of ``device``, creating it on first use (thread-safe).

    Every device index has its own runtime, so a worker on ``npu:3`` enqueues on device 3's streams.
    Pass the device when it is known (the device of the tensors, vLLM's ``device`` argument): torch's
    current device is per thread, and a thread that never called ``set_device`` is on device 0.

    Args:
        device: A device index, ``"npu:3"`` / ``torch.device("npu", 3)``, or None (and a device
            without an index, such as ``"cpu"``): the calling thread's current device, see
            `current_device_index`.

    Returns:
        The runtime of the backend `select_backend` chose, bound to that device.

    Raises:
        ConfigError: ``ASCEND_DIST_DEVICE`` names an unknown backend, or ``device`` names another backend.
        DeviceUnavailable: The backend or that device cannot be used here.
    """
    with _PROCESS.lock:
        backend = _backend_locked()
        index = _requested_index(backend, device)
        if index is None:
            index = _current_index_locked(backend)
        runtime = _PROCESS.runtimes.get(index)
        if runtime is None:
            runtime = create_runtime(backend, device_index=index)
            _PROCESS.runtimes[index] = runtime
        return runtime


def tensors_runtime(tensors: Iterable[Any]) -> DeviceRuntime:  # torch tensors: not imported here
    """The runtime of the device ``tensors`` live on (a KV cache's layers, a model's parameters).

    CPU tensors (the simulation) carry no index: they mean the current device.

    Raises:
        ConfigError: No tensors, or tensors on different devices.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ConfigError("tensors", sorted(str(d) for d in devices), "tensors on exactly one device")
    return get_runtime(devices.pop())


def current_device_index() -> int:
    """The calling thread's current device index on the selected backend.

    npu/cuda: torch's current device (``torch.npu.current_device()``), which vLLM's worker sets to its
    local rank; cpu: the simulated device last passed to `set_current_device` (0 by default).
    """
    with _PROCESS.lock:
        return _current_index_locked(_backend_locked())


def set_current_device(index: int) -> None:
    """Make device ``index`` current: torch's ``set_device`` on npu/cuda, the simulated one on cpu.

    Raises:
        ConfigError: ``index`` is not a non-negative int.
    """
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigError("index", index, "a non-negative device index")
    with _PROCESS.lock:
        backend = _backend_locked()
        if backend == "cpu":
            _PROCESS.sim_current = index
            return
    from ascend_dist.common.device.torch_backend import set_current_device_index

    set_current_device_index(backend, index)


def close_runtime() -> None:
    """Close every runtime of this process; a later `get_runtime` makes new ones and re-selects the backend."""
    with _PROCESS.lock:
        runtimes = list(_PROCESS.runtimes.values())
        _PROCESS.runtimes.clear()
        _PROCESS.backend = None
        _PROCESS.sim_current = 0
    errors: list[Exception] = []
    for runtime in runtimes:
        try:
            runtime.close()
        except Exception as exc:  # close the rest, then report the first failure
            logger.warning("closing the %s:%d runtime failed: %s", runtime.name, runtime.device_index, exc)
            errors.append(exc)
    if errors:
        raise errors[0]
