"""IPC of CUDA and NPU tensors through torch's storage-sharing primitives, without pickle.

Runs in: worker processes on the ``cuda`` or ``npu`` backend sharing device memory on one machine.

torch shares a CUDA storage with ``UntypedStorage._share_cuda_()``, which returns eight parts
(device, IPC memory handle, storage size, offset inside the allocation, ref-counter file and offset,
IPC event handle, whether the consumer must wait on that event), and rebuilds it in another process
with ``UntypedStorage._new_shared_cuda(*parts)``; torch_npu offers ``_share_npu_`` /
``_new_shared_npu`` with the same eight parts. torch.multiprocessing pickles these; we encode them
as a msgpack Struct inside `IpcHandle.payload` and rebuild the tensor view with ``Tensor.set_``.
The producer must keep its tensor alive while consumers use it (torch's ref counter keeps the block
from being reused until every consumer storage is freed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import msgspec

from ascend_dist.common.device.ipc import (
    IPC_HANDLE_VERSION,
    IpcHandle,
    dtype_from_str,
    dtype_to_str,
    strided_extent,
)
from ascend_dist.common.errors import ConfigError, DeviceUnavailable, ProtocolError

if TYPE_CHECKING:
    import torch

__all__ = ["open_storage_handle", "share_storage_handle"]


class _SharedStorage(msgspec.Struct, frozen=True, array_like=True):
    """The eight parts of torch's ``_share_<backend>_()``, in its order."""

    device: int
    handle: bytes
    storage_nbytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(_SharedStorage)


def share_storage_handle(tensor: torch.Tensor, backend: str, device_index: int) -> IpcHandle:
    """Describe a device tensor for `open_storage_handle` in another process.

    Args:
        tensor: A tensor on the runtime's device, with allocated storage.
        backend: ``"cuda"`` or ``"npu"``.
        device_index: The sharing process's device index (recorded in the handle).

    Returns:
        The handle.

    Raises:
        ConfigError: The tensor has no storage to share (zero bytes).
        DeviceUnavailable: This torch lacks the backend's sharing primitive.
    """
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        raise ConfigError("tensor", f"{backend} tensor with an empty storage", "a tensor with storage")
    share = getattr(storage, f"_share_{backend}_", None)
    if share is None:
        raise DeviceUnavailable(f"this torch has no UntypedStorage._share_{backend}_ (IPC unsupported)")
    device, handle, nbytes, offset, rc_handle, rc_offset, event_handle, event_sync = share()
    if handle is None:  # torch shares a storage without data as all-None parts
        raise ConfigError("tensor", f"{backend} tensor without device data", "a tensor with storage")
    payload = _SharedStorage(
        device=int(device),
        handle=bytes(handle),
        storage_nbytes=int(nbytes),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(rc_handle),
        ref_counter_offset=int(rc_offset),
        event_handle=None if event_handle is None else bytes(event_handle),
        event_sync_required=bool(event_sync),
    )
    return IpcHandle(
        version=IPC_HANDLE_VERSION,
        backend=backend,
        payload=_ENCODER.encode(payload),
        offset=int(tensor.storage_offset()) * tensor.element_size(),
        nbytes=storage.nbytes(),
        dtype=dtype_to_str(tensor.dtype),
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        device_index=device_index,
    )


def open_storage_handle(handle: IpcHandle, backend: str, device: torch.device) -> torch.Tensor:
    """Map a tensor shared by `share_storage_handle` onto ``device`` of this process.

    Args:
        handle: The received handle (of ``backend``).
        backend: ``"cuda"`` or ``"npu"``.
        device: The local device the allocation lives on.

    Returns:
        A tensor viewing the producer's memory.

    Raises:
        ProtocolError: The payload is malformed or the view does not fit the storage.
        DeviceUnavailable: This torch lacks the backend's rebuild primitive.
    """
    import torch

    try:
        parts = _DECODER.decode(handle.payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {backend} IpcHandle.payload: {exc}") from exc
    dtype = dtype_from_str(handle.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    extent = strided_extent(handle.shape, handle.stride) * itemsize
    if handle.offset % itemsize or handle.offset + extent > parts.storage_nbytes:
        raise ProtocolError(
            f"IpcHandle offset={handle.offset} with {extent} bytes of {handle.dtype} "
            f"does not fit a {parts.storage_nbytes}-byte storage"
        )
    rebuild = getattr(torch.UntypedStorage, f"_new_shared_{backend}", None)
    if rebuild is None:
        raise DeviceUnavailable(f"this torch has no UntypedStorage._new_shared_{backend} (IPC unsupported)")
    storage = rebuild(
        device.index,
        parts.handle,
        parts.storage_nbytes,
        parts.storage_offset_bytes,
        parts.ref_counter_handle,
        parts.ref_counter_offset,
        parts.event_handle,
        parts.event_sync_required,
    )
    view = torch.empty((0,), dtype=dtype, device=device)
    return view.set_(storage, handle.offset // itemsize, handle.shape, handle.stride)
