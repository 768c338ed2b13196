"""The device-runtime contract: copy directions, descriptor batches and the runtime Protocols.

Runs in: every process that touches device memory (worker processes, test processes).

Every component reaches hardware only through a `DeviceRuntime` (docs/architecture.md#device-runtime), so the
same logic runs on an Ascend NPU, a CUDA GPU or the CPU simulation with identical semantics. This
module holds what all three backends share and imports neither torch nor any backend: the
Protocols, the fixed `CopyDirection` codes (shared with the native batch-copy op), the 4096
descriptor cap per native call (CANN's batch-copy limit) and the validation of a
descriptor batch, so every backend rejects bad input with the same `ConfigError`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from ascend_dist.common.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ascend_dist.common.device.ipc import IpcHandle

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_DESCRIPTORS_PER_CALL",
    "CopyDirection",
    "DescriptorBatch",
    "DescriptorArray",
    "DeviceRuntime",
    "Event",
    "Shape",
    "Stream",
    "split_descriptors",
    "tensor_shape",
    "validate_batch",
]

MAX_DESCRIPTORS_PER_CALL: Final[int] = 4096
"""Most descriptors one native batch-copy call may carry (CANN's cap); larger batches are split."""

DEFAULT_TIMEOUT_S: Final[float] = 60.0
"""Deadline of every blocking wait whose caller passes ``timeout=None``."""

DescriptorArray: TypeAlias = "Sequence[int] | npt.NDArray[np.integer]"
"""Addresses or byte counts of a batch: a sequence of ints or a 1-D integer numpy array."""

Shape: TypeAlias = "int | Sequence[int]"
"""A tensor shape: one int for a 1-D tensor, or a sequence of ints."""


class CopyDirection(enum.IntEnum):
    """Direction of a batched copy; the codes are fixed and shared with the native op."""

    H2D = 0
    D2H = 1
    D2D = 2


def split_descriptors(n: int, limit: int = MAX_DESCRIPTORS_PER_CALL) -> list[slice]:
    """Split ``n`` descriptors into consecutive slices of at most ``limit`` each.

    Args:
        n: Number of descriptors in the batch (>= 0).
        limit: Most descriptors per native call (>= 1).

    Returns:
        Slices covering ``[0, n)`` in order; empty when ``n == 0``.

    Raises:
        ConfigError: ``n`` is negative or ``limit`` is not positive.
    """
    if n < 0:
        raise ConfigError("n", n, "a non-negative descriptor count")
    if limit < 1:
        raise ConfigError("limit", limit, "a positive descriptor count per call")
    return [slice(start, min(start + limit, n)) for start in range(0, n, limit)]


def tensor_shape(shape: Shape) -> tuple[int, ...]:
    """Normalise a shape argument to a tuple of sizes.

    Args:
        shape: One int or a sequence of ints.

    Returns:
        The sizes as a tuple.

    Raises:
        ConfigError: A size is negative or not an int.
    """
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ConfigError("shape", shape, "non-negative integer sizes")
    return dims


@dataclass(frozen=True)
class DescriptorBatch:
    """A validated batch of copy descriptors: three int64 arrays of equal length and a direction.

    The arrays are private copies, so the caller may reuse its buffers as soon as
    `DeviceRuntime.batch_copy` returns.
    """

    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    direction: CopyDirection

    def __len__(self) -> int:
        """Number of descriptors."""
        return int(self.sizes.shape[0])


def _as_int64(field: str, values: DescriptorArray) -> npt.NDArray[np.int64]:
    """Copy ``values`` into a fresh 1-D int64 array, rejecting non-integer data."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ConfigError(field, f"array of shape {arr.shape}", "a 1-D sequence of integers")
    if arr.size and arr.dtype.kind not in "iu":
        raise ConfigError(field, f"array of dtype {arr.dtype}", "integers (numpy int64 or Python ints)")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ConfigError(field, int(arr.max()), "values that fit in int64")
    return np.array(arr, dtype=np.int64, copy=True)


def validate_batch(
    src_ptrs: DescriptorArray,
    dst_ptrs: DescriptorArray,
    sizes: DescriptorArray,
    direction: CopyDirection | int,
) -> DescriptorBatch:
    """Check a batch-copy request and return private int64 copies of its arrays.

    Args:
        src_ptrs: Source addresses, one per descriptor.
        dst_ptrs: Destination addresses, one per descriptor.
        sizes: Byte counts, one per descriptor (0 is allowed and copies nothing).
        direction: A `CopyDirection` or its integer code.

    Returns:
        The validated batch.

    Raises:
        ConfigError: Bad direction, arrays of different lengths, non-integer data, a negative
            size, or a null or negative address on a descriptor that copies bytes. The error
            names the offending field.
    """
    try:
        checked_direction = CopyDirection(direction)
    except ValueError:
        raise ConfigError("direction", direction, "H2D (0), D2H (1) or D2D (2)") from None
    src = _as_int64("src_ptrs", src_ptrs)
    dst = _as_int64("dst_ptrs", dst_ptrs)
    size_arr = _as_int64("sizes", sizes)
    if not len(src) == len(dst) == len(size_arr):
        raise ConfigError(
            "src_ptrs/dst_ptrs/sizes",
            f"lengths {len(src)}/{len(dst)}/{len(size_arr)}",
            "three arrays of equal length",
        )
    if size_arr.size:
        if int(size_arr.min()) < 0:
            bad = int(np.argmax(size_arr < 0))
            raise ConfigError(f"sizes[{bad}]", int(size_arr[bad]), "a non-negative byte count")
        copying = size_arr > 0
        for field, arr in (("src_ptrs", src), ("dst_ptrs", dst)):
            invalid = copying & (arr <= 0)
            if invalid.any():
                bad = int(np.argmax(invalid))
                raise ConfigError(f"{field}[{bad}]", int(arr[bad]), "a non-null address")
    return DescriptorBatch(src=src, dst=dst, sizes=size_arr, direction=checked_direction)


@runtime_checkable
class Event(Protocol):
    """A marker in a stream's work queue (torch.cuda.Event semantics).

    Every wait is bounded: ``timeout=None`` means `DEFAULT_TIMEOUT_S`, and a wait that runs out
    raises `DeadlineExceeded`.
    """

    def record(self, stream: Stream | None = None) -> None:
        """Capture the work enqueued so far on ``stream`` (default: the current stream)."""
        ...

    def query(self) -> bool:
        """Return True once the captured work has completed."""
        ...

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until the captured work has completed."""
        ...

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and ``end`` (both recorded with ``timing=True``)."""
        ...


@runtime_checkable
class Stream(Protocol):
    """An in-order work queue of a device (torch.cuda.Stream semantics)."""

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every operation enqueued so far has completed."""
        ...

    def query(self) -> bool:
        """Return True when no enqueued operation is pending."""
        ...

    def wait_event(self, event: Event) -> None:
        """Make work enqueued after this call wait until ``event`` has completed."""
        ...

    def wait_stream(self, other: Stream) -> None:
        """Make work enqueued after this call wait for everything enqueued on ``other`` so far."""
        ...

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) on this stream and return it."""
        ...


@runtime_checkable
class DeviceRuntime(Protocol):
    """The one interface through which ascend_dist touches device hardware.

    Implementations: `TorchDeviceRuntime` (``npu``, ``cuda``) and `CpuSimRuntime` (``cpu``).
    """

    name: str
    device_index: int

    def new_stream(self, *, priority: int = 0) -> Stream:
        """Create a stream (a worker thread in the simulation)."""
        ...

    def current_stream(self) -> Stream:
        """Return the calling thread's current stream (the compute stream unless changed)."""
        ...

    def compute_stream(self) -> Stream:
        """Return the distinguished default stream the model computes on."""
        ...

    def use_stream(self, stream: Stream) -> AbstractContextManager[Stream]:
        """Make ``stream`` the calling thread's current stream inside a ``with`` block."""
        ...

    def new_event(self, *, timing: bool = False) -> Event:
        """Create an event; ``timing=True`` enables `Event.elapsed_ms`."""
        ...

    def empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate uninitialised device memory."""
        ...

    def pinned_empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate uninitialised pinned host memory."""
        ...

    def batch_copy(
        self,
        src_ptrs: DescriptorArray,
        dst_ptrs: DescriptorArray,
        sizes: DescriptorArray,
        direction: CopyDirection | int,
        *,
        stream: Stream | None = None,
    ) -> None:
        """Enqueue ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every i."""
        ...

    def launch_host_func(self, stream: Stream, fn: Callable[[], object]) -> None:
        """Enqueue a host callback that runs when ``stream`` reaches it."""
        ...

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until all work on every stream has completed."""
        ...

    def ipc_handle(self, tensor: torch.Tensor) -> IpcHandle:
        """Describe ``tensor`` so that another process can map the same memory."""
        ...

    def open_ipc_handle(self, handle: IpcHandle) -> torch.Tensor:
        """Map memory described by an `IpcHandle` from another process."""
        ...

    def close(self) -> None:
        """Release every resource and join every thread this runtime started; idempotent."""
        ...
