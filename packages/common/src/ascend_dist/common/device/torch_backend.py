"""The ``npu`` and ``cuda`` device backends, over ``torch.npu`` / ``torch.cuda``.

Runs in: worker processes on Ascend NPUs (torch_npu + CANN) or NVIDIA GPUs.

Streams, events, ``with stream`` and synchronisation are torch's; batched copies go through the
native async memcpy (`_native_copy`), IPC through torch's storage sharing (`_torch_ipc`).
Torch's own waits have no deadline, so every wait here polls ``query()`` with a short back-off
until the deadline and then raises `DeadlineExceeded`. Pinned host memory comes from torch's
pinned allocator (``pin_memory=True``).

This module imports torch (after `prepare_torch_import`); `ascend_dist.common.device` imports it
only when a hardware backend is created.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

from ascend_dist.common.device.detect import prepare_torch_import

prepare_torch_import()  # must precede the first `import torch`: torch_npu's autoload can break it without CANN

import torch  # noqa: E402

from ascend_dist.common.device._native_copy import AclRuntimeLib, CudaRuntimeLib  # noqa: E402
from ascend_dist.common.device._torch_ipc import open_storage_handle, share_storage_handle  # noqa: E402
from ascend_dist.common.device.base import (  # noqa: E402
    DEFAULT_TIMEOUT_S,
    CopyDirection,
    DescriptorArray,
    Event,
    Shape,
    Stream,
    tensor_shape,
    validate_batch,
)
from ascend_dist.common.device.ipc import IpcHandle  # noqa: E402
from ascend_dist.common.errors import ConfigError, DeadlineExceeded, DeviceError, DeviceUnavailable  # noqa: E402

__all__ = ["TorchDeviceRuntime", "TorchEvent", "TorchStream", "current_device_index", "set_current_device_index"]

logger = logging.getLogger(__name__)

_POLL_START_S = 20e-6
_POLL_MAX_S = 1e-3


def _wait_until(done: Callable[[], bool], timeout: float | None, what: str) -> None:
    """Poll ``done`` with exponential back-off until it holds or the deadline passes."""
    limit = DEFAULT_TIMEOUT_S if timeout is None else timeout
    end = time.monotonic() + limit
    pause = _POLL_START_S
    while not done():
        if time.monotonic() >= end:
            raise DeadlineExceeded(f"{what} did not complete within {limit:g} s")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _device_module(name: str) -> Any:  # torch.cuda or torch.npu; the latter has no stubs
    """Return ``torch.cuda`` or (after importing torch_npu defensively) ``torch.npu``."""
    if name == "cuda":
        return torch.cuda
    try:
        importlib.import_module("torch_npu")
    except (ImportError, OSError, RuntimeError) as exc:
        raise DeviceUnavailable(f"torch_npu present but unusable: {type(exc).__name__}: {exc}") from exc
    return torch.npu  # pyright: ignore[reportAttributeAccessIssue]


def current_device_index(name: str) -> int:
    """The calling thread's current device of ``torch.npu`` / ``torch.cuda`` (0 until ``set_device``)."""
    return int(_device_module(name).current_device())


def set_current_device_index(name: str, index: int) -> None:
    """Make device ``index`` the calling thread's current device."""
    _device_module(name).set_device(index)


class TorchEvent:
    """A torch.cuda / torch.npu event behind the `Event` Protocol."""

    def __init__(self, runtime: TorchDeviceRuntime, raw: Any) -> None:
        """Wrap ``raw`` (a torch event of ``runtime``'s backend)."""
        self._runtime = runtime
        self.raw = raw

    def record(self, stream: Stream | None = None) -> None:
        """Record on ``stream`` (default: the current stream)."""
        self.raw.record(self._runtime.own(stream).raw)

    def query(self) -> bool:
        """Return True once the recorded work has completed."""
        return bool(self.raw.query())

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for the recorded work, at most ``timeout`` s (None: `DEFAULT_TIMEOUT_S`)."""
        _wait_until(self.query, timeout, "event")

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both created with ``timing=True``)."""
        if not isinstance(end, TorchEvent):
            raise ConfigError("end", end, "an event of the same TorchDeviceRuntime")
        try:
            return float(self.raw.elapsed_time(end.raw))
        except RuntimeError as exc:  # not recorded, not complete, or created without timing
            raise DeviceError(f"elapsed_ms failed: {exc}") from exc


class TorchStream:
    """A torch.cuda / torch.npu stream behind the `Stream` Protocol."""

    def __init__(self, runtime: TorchDeviceRuntime, raw: Any) -> None:
        """Wrap ``raw`` (a torch stream of ``runtime``'s backend)."""
        self._runtime = runtime
        self.raw = raw

    @property
    def handle(self) -> int:
        """The native stream handle (``cudaStream_t`` / ``aclrtStream``) as an integer."""
        return int(self.raw.cuda_stream if self._runtime.name == "cuda" else self.raw.npu_stream)

    def __eq__(self, other: object) -> bool:
        """Streams are equal when they wrap the same native stream."""
        return isinstance(other, TorchStream) and other.handle == self.handle

    def __hash__(self) -> int:
        """Hash by native handle."""
        return hash(self.handle)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until all work enqueued so far completed (None: `DEFAULT_TIMEOUT_S`)."""
        _wait_until(self.query, timeout, f"{self._runtime.name} stream")

    def query(self) -> bool:
        """Return True when no enqueued work is pending."""
        return bool(self.raw.query())

    def wait_event(self, event: Event) -> None:
        """Make later work wait for ``event``."""
        if not isinstance(event, TorchEvent):
            raise ConfigError("event", event, "an event of the same TorchDeviceRuntime")
        self.raw.wait_event(event.raw)

    def wait_stream(self, other: Stream) -> None:
        """Make later work wait for everything enqueued on ``other`` so far."""
        self.raw.wait_stream(self._runtime.own(other).raw)

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) here and return it."""
        target = self._runtime.new_event() if event is None else event
        target.record(self)
        return target


class TorchDeviceRuntime:
    """Device runtime over torch's CUDA or NPU module."""

    def __init__(self, name: Literal["npu", "cuda"], device_index: int = 0) -> None:
        """Bind to ``device_index`` of the backend.

        Raises:
            ConfigError: ``name`` is not npu/cuda or ``device_index`` is negative.
            DeviceUnavailable: The backend or the device is not present.
        """
        if name not in ("npu", "cuda"):
            raise ConfigError("name", name, "'npu' or 'cuda'")
        if device_index < 0:
            raise ConfigError("device_index", device_index, "a non-negative device index")
        self._mod = _device_module(name)
        if not self._mod.is_available() or device_index >= self._mod.device_count():
            raise DeviceUnavailable(f"{name}:{device_index} is not present on this machine")
        self.name: str = name
        self.device_index = device_index
        self.device = torch.device(name, device_index)
        # Initialise the device context now, not inside the first copy (torch.npu names it like CUDA).
        init = getattr(self._mod, "init", None) or self._mod._lazy_init
        init()
        self._compute = TorchStream(self, self._mod.default_stream(self.device))
        self._streams: list[TorchStream] = [self._compute]
        self._lib: CudaRuntimeLib | AclRuntimeLib | None = None
        self._subscribed: list[Any] = []  # NPU streams subscribed for host functions
        self._closed = False

    def own(self, stream: Stream | None) -> TorchStream:
        """Resolve ``stream`` (None: current) and check it is a stream of this backend."""
        if stream is None:
            return self.current_stream()
        if not isinstance(stream, TorchStream):
            raise ConfigError("stream", stream, f"a {self.name} stream of a TorchDeviceRuntime")
        return stream

    def new_stream(self, *, priority: int = 0) -> TorchStream:
        """Create a stream (CUDA priorities: lower numbers run first; transfer streams use 0)."""
        stream = TorchStream(self, self._mod.Stream(device=self.device, priority=priority))
        self._streams.append(stream)
        return stream

    def current_stream(self) -> TorchStream:
        """Return the calling thread's current stream on this device."""
        return TorchStream(self, self._mod.current_stream(self.device))

    def compute_stream(self) -> TorchStream:
        """Return the device's default stream."""
        return self._compute

    @contextmanager
    def use_stream(self, stream: Stream) -> Iterator[TorchStream]:
        """Make ``stream`` current for this thread inside the ``with`` block."""
        own = self.own(stream)
        with self._mod.stream(own.raw):
            yield own

    def new_event(self, *, timing: bool = False) -> TorchEvent:
        """Create an event; ``timing=True`` enables `TorchEvent.elapsed_ms`."""
        return TorchEvent(self, self._mod.Event(enable_timing=timing))

    def empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate uninitialised device memory."""
        return torch.empty(tensor_shape(shape), dtype=dtype, device=self.device)

    def pinned_empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate uninitialised pinned host memory."""
        return torch.empty(tensor_shape(shape), dtype=dtype, pin_memory=True)

    def _native(self) -> CudaRuntimeLib | AclRuntimeLib:
        if self._lib is None:
            self._lib = CudaRuntimeLib() if self.name == "cuda" else AclRuntimeLib()
            logger.debug("%s batch copy through %s", self.name, self._lib.path)
        return self._lib

    def batch_copy(
        self,
        src_ptrs: DescriptorArray,
        dst_ptrs: DescriptorArray,
        sizes: DescriptorArray,
        direction: CopyDirection | int,
        *,
        stream: Stream | None = None,
    ) -> None:
        """Enqueue one async memcpy per descriptor, in calls of at most 4096, on one stream.

        Raises:
            ConfigError: Invalid batch (see `validate_batch`).
            BatchCopyError: The runtime refused descriptor ``index``; earlier ones were enqueued.
        """
        batch = validate_batch(src_ptrs, dst_ptrs, sizes, direction)
        target = self.own(stream)
        if len(batch) == 0:
            return
        with self._mod.device(self.device_index):
            self._native().copy(batch, target.handle)

    def launch_host_func(self, stream: Stream, fn: Callable[[], object]) -> None:
        """Enqueue ``fn`` on ``stream``; it runs on a runtime thread and must not call the device."""
        target = self.own(stream)
        if self.name == "cuda":
            lib = self._native()
            if not isinstance(lib, CudaRuntimeLib):  # unreachable: the cuda backend loads libcudart
                raise DeviceError(f"host functions need libcudart, have {lib.path}")
            lib.launch_host_func(target.handle, fn)
            return
        npu = self._mod
        if all(s is not target.raw for s in self._subscribed):
            npu._subscribe_report(target.raw)  # one report thread per stream, released in close()
            self._subscribed.append(target.raw)
        npu._launch_host_func(target.raw, lambda _args: fn(), None)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait (with the deadline) for this runtime's streams, then synchronise the device."""
        end = time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else timeout)
        for stream in [*self._streams, self.current_stream()]:
            stream.record_event().synchronize(max(end - time.monotonic(), 0.0))
        self._mod.synchronize(self.device)

    def ipc_handle(self, tensor: torch.Tensor) -> IpcHandle:
        """Describe a tensor on this device for `open_ipc_handle` in another process.

        Raises:
            DeviceError: ``tensor`` is not on this runtime's device.
        """
        if tensor.device != self.device:
            raise DeviceError(f"ipc_handle needs a tensor on {self.device}, got one on {tensor.device}")
        return share_storage_handle(tensor, self.name, self.device_index)

    def open_ipc_handle(self, handle: IpcHandle) -> torch.Tensor:
        """Map a tensor shared by another process on this machine onto this runtime's device.

        Raises:
            DeviceError: The handle comes from another backend.
        """
        if handle.backend != self.name:
            raise DeviceError(f"cannot open an IPC handle of backend {handle.backend!r} on {self.name}")
        return open_storage_handle(handle, self.name, self.device)

    def close(self) -> None:
        """Release host-function subscriptions; idempotent (torch owns streams and memory)."""
        if self._closed:
            return
        self._closed = True
        for raw in self._subscribed:
            try:
                self._mod._unsubscribe_report(raw)
            except RuntimeError as exc:
                logger.warning("unsubscribing NPU stream from host-function reports failed: %s", exc)
        self._subscribed.clear()
