"""The ``cpu`` device backend: a faithful simulation of an accelerator runtime on host memory.

Runs in: test processes and CPU-only development machines (``ASCEND_DIST_DEVICE=cpu``).

"Device" memory is ordinary CPU tensors, so addresses are real and all descriptor arithmetic
(source/destination address, length) runs unchanged; a batched copy is a ``ctypes.memmove`` per descriptor, run on
the stream's worker thread. Streams and events follow CUDA's semantics (see `_sim_stream`), with
three test hooks the hardware lacks:

- manual mode (``manual=True``): no threads; the test advances each stream with
  `SimStream.step`, so ordering rules ("D2H starts only after compute wrote the block") can be
  proven step by step;
- latency injection (``copy_latency_s``): each native copy call (at most 4096 descriptors) sleeps
  first;
- fault injection (`CpuSimRuntime.inject_copy_fault`): the next batch copy stops at descriptor k.
  The failure is sticky like CUDA's: the stream's next ``synchronize()`` raises the
  `BatchCopyError` (whose ``index`` is k), and so does ``synchronize()`` of any event recorded on
  the stream after the failure.

IPC uses named shared memory: allocate with `CpuSimRuntime.empty_shared`, send
`CpuSimRuntime.ipc_handle`, and the peer's `CpuSimRuntime.open_ipc_handle` maps the same bytes.
Shared tensors are views of mappings this runtime owns: they must not be used after `close`.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ascend_dist.common.device._sim_ipc import SharedTensors
from ascend_dist.common.device._sim_stream import SimCore, SimEvent, SimStream
from ascend_dist.common.device.base import (
    DEFAULT_TIMEOUT_S,
    CopyDirection,
    DescriptorArray,
    DescriptorBatch,
    Shape,
    Stream,
    split_descriptors,
    tensor_shape,
    validate_batch,
)
from ascend_dist.common.device.detect import prepare_torch_import
from ascend_dist.common.device.ipc import IpcHandle
from ascend_dist.common.errors import (
    AscendDistError,
    BatchCopyError,
    ConfigError,
    DeadlineExceeded,
    DeviceError,
)

if TYPE_CHECKING:
    import torch

__all__ = ["CpuSimRuntime", "SimEvent", "SimStream"]

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S: Final[float] = DEFAULT_TIMEOUT_S
"""How long `CpuSimRuntime.close` waits for each worker thread to finish its queue."""


@dataclass(frozen=True)
class _Fault:
    index: int
    reason: str


class _BatchState:
    """Shared by the native calls of one batch: once one fails, the rest do nothing."""

    def __init__(self) -> None:
        self.failed = False


class CpuSimRuntime:
    """Device runtime that simulates an accelerator on the CPU (backend name ``cpu``)."""

    name: str = "cpu"
    device_index: int = 0

    def __init__(
        self,
        *,
        manual: bool = False,
        copy_latency_s: float = 0.0,
        wait_timeout_s: float = DEFAULT_TIMEOUT_S,
        device_index: int = 0,
    ) -> None:
        """Create the runtime and its compute stream.

        Args:
            device_index: The simulated device this runtime stands for (IPC handles carry it), so
                several ranks of one host can each run on their own simulated device.
            manual: No worker threads; streams advance only through `SimStream.step`.
            copy_latency_s: Seconds each native copy call (<= 4096 descriptors) sleeps first.
            wait_timeout_s: How long a stream blocked on an event waits before failing with
                `DeadlineExceeded` (threaded mode).

        Raises:
            ConfigError: A negative latency or a non-positive wait timeout.
        """
        if copy_latency_s < 0:
            raise ConfigError("copy_latency_s", copy_latency_s, "a non-negative number of seconds")
        if wait_timeout_s <= 0:
            raise ConfigError("wait_timeout_s", wait_timeout_s, "a positive number of seconds")
        if isinstance(device_index, bool) or not isinstance(device_index, int) or device_index < 0:
            raise ConfigError("device_index", device_index, "a non-negative device index")
        self.device_index = device_index
        self._core = SimCore(manual=manual, wait_timeout_s=wait_timeout_s)
        self._copy_latency_s = copy_latency_s
        self._local = threading.local()
        self._streams: list[SimStream] = []
        self._fault: _Fault | None = None
        self._shared = SharedTensors(self.name, self.device_index)
        self._closed = False
        self._alloc_lock = threading.Lock()
        self._allocated = 0
        self._peak_allocated = 0
        self._compute = self._make_stream("compute", 0)

    @property
    def manual(self) -> bool:
        """Whether streams advance only by `SimStream.step`."""
        return self._core.manual

    def __enter__(self) -> CpuSimRuntime:
        """Use the runtime as a context manager that closes it on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close the runtime."""
        self.close()

    # -- streams and events -----------------------------------------------------------------------

    def _make_stream(self, label: str, priority: int) -> SimStream:
        with self._core.cv:
            self._check_open()
            stream = SimStream(self._core, f"{label}-{len(self._streams)}", priority, self.new_event)
            self._streams.append(stream)
        return stream

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError("the CpuSimRuntime is closed")

    def new_stream(self, *, priority: int = 0) -> SimStream:
        """Create a stream with its own worker thread (none in manual mode).

        Args:
            priority: Recorded for parity with CUDA; the simulation does not prioritise.

        Returns:
            The stream.
        """
        return self._make_stream("stream", priority)

    def compute_stream(self) -> SimStream:
        """Return the distinguished default stream."""
        return self._compute

    def current_stream(self) -> SimStream:
        """Return the calling thread's current stream (the compute stream unless changed)."""
        stream: SimStream | None = getattr(self._local, "stream", None)
        return self._compute if stream is None else stream

    def _own(self, stream: Stream | None) -> SimStream:
        """Resolve ``stream`` (None: the current stream) and check that it belongs to this runtime."""
        if stream is None:
            return self.current_stream()
        if not isinstance(stream, SimStream) or stream not in self._streams:
            raise ConfigError("stream", stream, "a stream created by this CpuSimRuntime")
        return stream

    @contextmanager
    def use_stream(self, stream: Stream) -> Iterator[SimStream]:
        """Make ``stream`` the calling thread's current stream inside the ``with`` block."""
        own = self._own(stream)
        previous = getattr(self._local, "stream", None)
        self._local.stream = own
        try:
            yield own
        finally:
            self._local.stream = previous

    def new_event(self, *, timing: bool = False) -> SimEvent:
        """Create an event; ``timing=True`` enables `SimEvent.elapsed_ms`."""
        return SimEvent(self._core, self.current_stream, timing=timing)

    def run_until_idle(self, max_ops: int = 1_000_000) -> int:
        """Manual mode: step every stream round-robin until none can progress.

        Args:
            max_ops: Safety bound on the operations run.

        Returns:
            How many operations ran.
        """
        ran = 0
        progressed = True
        while progressed and ran < max_ops:
            progressed = False
            for stream in list(self._streams):
                done = stream.step(1)
                ran += done
                progressed = progressed or done > 0
        return ran

    # -- memory -----------------------------------------------------------------------------------

    def empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a CPU tensor standing in for device memory (counted by `allocated_bytes`)."""
        prepare_torch_import()
        import torch

        tensor = torch.empty(tensor_shape(shape), dtype=dtype)
        nbytes = tensor.numel() * tensor.element_size()
        with self._alloc_lock:
            self._allocated += nbytes
            self._peak_allocated = max(self._peak_allocated, self._allocated)
        # views keep their base alive, so the finaliser runs when the last view of it is gone
        weakref.finalize(tensor, self._release_bytes, nbytes)
        return tensor

    def _release_bytes(self, nbytes: int) -> None:
        with self._alloc_lock:
            self._allocated -= nbytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of `empty` allocations still alive (what a device allocator would hold)."""
        with self._alloc_lock:
            return self._allocated

    @property
    def peak_allocated_bytes(self) -> int:
        """Most `allocated_bytes` seen since creation or the last `reset_peak_allocated`."""
        with self._alloc_lock:
            return self._peak_allocated

    def reset_peak_allocated(self) -> None:
        """Start a new peak from the bytes allocated now (to measure one operation's peak)."""
        with self._alloc_lock:
            self._peak_allocated = self._allocated

    def pinned_empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a plain CPU tensor standing in for pinned host memory."""
        prepare_torch_import()
        import torch

        return torch.empty(tensor_shape(shape), dtype=dtype)

    # -- copies -----------------------------------------------------------------------------------

    def inject_copy_fault(self, at_descriptor: int, *, reason: str = "injected") -> None:
        """Make the next `batch_copy` copy descriptors ``[0, k)`` and fail at ``k``.

        Args:
            at_descriptor: ``k``, the global index of the failing descriptor.
            reason: Text carried by the `BatchCopyError`.

        Raises:
            ConfigError: ``at_descriptor`` is negative.
        """
        if at_descriptor < 0:
            raise ConfigError("at_descriptor", at_descriptor, "a non-negative descriptor index")
        with self._core.cv:
            self._fault = _Fault(at_descriptor, reason)

    def batch_copy(
        self,
        src_ptrs: DescriptorArray,
        dst_ptrs: DescriptorArray,
        sizes: DescriptorArray,
        direction: CopyDirection | int,
        *,
        stream: Stream | None = None,
    ) -> None:
        """Enqueue ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i.

        The batch is split into calls of at most 4096 descriptors, enqueued back to back on the
        stream; the arrays are copied, so the caller may reuse them at once.

        Args:
            src_ptrs: Source addresses.
            dst_ptrs: Destination addresses.
            sizes: Byte counts.
            direction: H2D, D2H or D2D (all host memory here; checked, not used).
            stream: Target stream (default: the calling thread's current stream).

        Raises:
            ConfigError: Invalid batch (see `validate_batch`) or a foreign stream.
            DeviceError: The runtime is closed.
        """
        self._check_open()
        batch = validate_batch(src_ptrs, dst_ptrs, sizes, direction)
        target = self._own(stream)
        if len(batch) == 0:
            return
        with self._core.cv:
            fault, self._fault = self._fault, None
        if fault is not None and fault.index >= len(batch):
            logger.warning("injected copy fault at %d is beyond a batch of %d descriptors", fault.index, len(batch))
        state = _BatchState()
        for part in split_descriptors(len(batch)):
            target.enqueue("batch_copy", self._copy_call(batch, part, fault, state))

    def _copy_call(
        self, batch: DescriptorBatch, part: slice, fault: _Fault | None, state: _BatchState
    ) -> Callable[[], None]:
        """Build the closure standing in for one native batch-copy call."""
        src = batch.src[part].tolist()
        dst = batch.dst[part].tolist()
        sizes = batch.sizes[part].tolist()
        first: int = part.start
        latency = self._copy_latency_s

        def run() -> None:
            if state.failed:
                return
            if latency:
                time.sleep(latency)
            for offset, (s, d, n) in enumerate(zip(src, dst, sizes, strict=True)):
                if fault is not None and first + offset == fault.index:
                    state.failed = True
                    raise BatchCopyError(fault.index, fault.reason)
                if n:
                    ctypes.memmove(d, s, n)

        return run

    def launch_host_func(self, stream: Stream, fn: Callable[[], object]) -> None:
        """Enqueue ``fn`` on ``stream``; an exception it raises becomes the stream's sticky error."""

        def run() -> None:
            fn()

        self._own(stream).enqueue("host_func", run)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for every stream to drain, then raise the first sticky error found.

        Raises:
            DeadlineExceeded: Work still pending after ``timeout`` (None: `DEFAULT_TIMEOUT_S`).
            BatchCopyError: A copy failed on some stream since its last synchronize.
        """
        end = time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else timeout)
        first_error: AscendDistError | None = None
        for stream in list(self._streams):
            try:
                stream.synchronize(max(end - time.monotonic(), 0.0))
            except DeadlineExceeded:
                raise
            except AscendDistError as exc:
                if first_error is None:
                    first_error = exc
                else:
                    logger.warning("synchronize: further stream error: %s", exc)
        if first_error is not None:
            raise first_error

    # -- IPC (shared memory; see _sim_ipc) --------------------------------------------------------

    def empty_shared(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a zero-filled tensor in named shared memory, shareable with `ipc_handle`.

        Args:
            shape: Tensor shape.
            dtype: Element type.

        Returns:
            A contiguous CPU tensor viewing a new segment owned by this runtime (valid until `close`).
        """
        self._check_open()
        return self._shared.empty(shape, dtype)

    def ipc_handle(self, tensor: torch.Tensor) -> IpcHandle:
        """Describe a shared-memory tensor so that another process can map it.

        Raises:
            DeviceError: ``tensor`` does not live in a segment from `empty_shared` (or an opened
                handle) of this runtime.
        """
        self._check_open()
        return self._shared.handle(tensor)

    def open_ipc_handle(self, handle: IpcHandle) -> torch.Tensor:
        """Map the tensor described by ``handle`` (from `ipc_handle` in any process).

        Raises:
            DeviceError: The handle comes from another backend, or its segment is gone.
            ProtocolError: The handle's offset, shape and size are inconsistent.
        """
        self._check_open()
        return self._shared.open(handle)

    # -- shutdown ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Let every stream finish its queue, join all worker threads, release shared memory.

        Idempotent. Blocked waits are abandoned; shared tensors become invalid.
        """
        with self._core.cv:
            if self._closed:
                return
            self._closed = True
            self._core.closing = True
            self._core.cv.notify_all()
            streams = list(self._streams)
        if self._core.manual:
            dropped = sum(stream.pending() for stream in streams)
            if dropped:
                logger.debug("close(): discarding %d operations never stepped (manual mode)", dropped)
        for stream in streams:
            if not stream.join(JOIN_TIMEOUT_S):
                logger.warning("stream %s did not finish within %g s of close()", stream.name, JOIN_TIMEOUT_S)
        self._shared.close()
