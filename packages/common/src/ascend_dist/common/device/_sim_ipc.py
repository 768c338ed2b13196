"""Shared-memory tensors of the CPU simulation: allocation, IPC handles, mapping a peer's handle.

Runs in: processes using the ``cpu`` device backend that share tensors.

A tensor allocated by `SharedTensors.empty` views a named segment (`ShmSegment`); its
`IpcHandle` carries the segment name as ``payload``, the byte offset of the first element inside
the segment, and dtype, shape and strides, so any strided view can be shared. Opening maps the same
bytes and rebuilds the view with ``Tensor.set_``. Every mapping is owned by the `SharedTensors`
that made it and is released by `SharedTensors.close`; tensors viewing it must not be used after.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

from ascend_dist.common.device._shm import ShmSegment
from ascend_dist.common.device.base import Shape, tensor_shape
from ascend_dist.common.device.detect import prepare_torch_import
from ascend_dist.common.device.ipc import (
    IPC_HANDLE_VERSION,
    IpcHandle,
    dtype_from_str,
    dtype_to_str,
    strided_extent,
)
from ascend_dist.common.errors import DeviceError, ProtocolError

if TYPE_CHECKING:
    import torch

__all__ = ["SharedTensors"]


class SharedTensors:
    """The shared-memory segments one runtime created or opened, keyed by base address."""

    def __init__(self, backend: str, device_index: int) -> None:
        """Start empty; handles are stamped with ``backend`` and ``device_index``."""
        self._backend = backend
        self._device_index = device_index
        self._lock = threading.Lock()
        self._segments: dict[int, ShmSegment] = {}

    def _register(self, segment: ShmSegment) -> torch.Tensor:
        """Map ``segment`` as a flat uint8 tensor and remember it by its base address."""
        prepare_torch_import()
        import torch

        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=max(segment.nbytes, 1))
        with self._lock:
            self._segments[flat.data_ptr()] = segment
        return flat

    def empty(self, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        """Allocate a zero-filled contiguous tensor in a new segment.

        Args:
            shape: Tensor shape.
            dtype: Element type.

        Returns:
            The tensor (valid until `close`).
        """
        prepare_torch_import()
        import torch

        dims = tensor_shape(shape)
        nbytes = torch.empty((), dtype=dtype).element_size() * math.prod(dims)
        flat = self._register(ShmSegment.create(nbytes))
        return flat[:nbytes].view(dtype).view(dims)

    def _segment_of(self, address: int) -> tuple[int, ShmSegment] | None:
        with self._lock:
            for base, segment in self._segments.items():
                if base <= address <= base + segment.nbytes:
                    return base, segment
        return None

    def handle(self, tensor: torch.Tensor) -> IpcHandle:
        """Describe a tensor living in one of these segments.

        Raises:
            DeviceError: ``tensor`` is not (entirely) inside a segment of this runtime.
        """
        found = self._segment_of(tensor.data_ptr())
        extent = strided_extent(tuple(tensor.shape), tuple(tensor.stride())) * tensor.element_size()
        if found is None or tensor.data_ptr() + extent > found[0] + found[1].nbytes:
            raise DeviceError(
                "ipc_handle on the cpu backend needs a tensor in shared memory: allocate it with "
                "CpuSimRuntime.empty_shared (this one is private CPU memory)"
            )
        base, segment = found
        return IpcHandle(
            version=IPC_HANDLE_VERSION,
            backend=self._backend,
            payload=segment.name.encode("ascii"),
            offset=tensor.data_ptr() - base,
            nbytes=segment.nbytes,
            dtype=dtype_to_str(tensor.dtype),
            shape=tuple(tensor.shape),
            stride=tuple(tensor.stride()),
            device_index=self._device_index,
        )

    def open(self, handle: IpcHandle) -> torch.Tensor:
        """Map the tensor a handle describes (from any process on this machine).

        Raises:
            DeviceError: The handle comes from another backend, or its segment is gone.
            ProtocolError: The handle's offset, shape and size are inconsistent.
        """
        if handle.backend != self._backend:
            raise DeviceError(f"cannot open an IPC handle of backend {handle.backend!r} on the {self._backend} backend")
        prepare_torch_import()
        import torch

        dtype = dtype_from_str(handle.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        extent = strided_extent(handle.shape, handle.stride) * itemsize
        if handle.offset % itemsize or handle.offset + extent > handle.nbytes:
            raise ProtocolError(
                f"IpcHandle offset={handle.offset} with {extent} bytes of {handle.dtype} "
                f"does not fit a {handle.nbytes}-byte segment"
            )
        try:
            name = handle.payload.decode("ascii")
        except UnicodeDecodeError:
            raise ProtocolError("IpcHandle.payload is not an ASCII segment name") from None
        flat = self._register(ShmSegment.open(name, handle.nbytes))
        view = torch.empty((0,), dtype=dtype)
        return view.set_(flat.untyped_storage(), handle.offset // itemsize, handle.shape, handle.stride)

    def close(self) -> None:
        """Unmap every segment and unlink the ones created here; idempotent."""
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
        for segment in segments:
            segment.close()
