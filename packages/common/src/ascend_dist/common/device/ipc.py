"""IPC handles: how one process describes device memory so that another can map the same bytes.

Runs in: any two processes on one machine sharing a tensor (same-chip weight transfer, the KV
pool's local path).

An `IpcHandle` is plain data (a frozen msgspec Struct) and travels as msgpack, never pickle. Its
``payload`` is backend specific: the shared-memory segment name for the CPU simulation, the
msgpack-encoded storage-sharing parts of torch for CUDA and NPU. Decoding is size bounded and
strict; anything malformed raises `ProtocolError`. The dtype mapping imports torch lazily, so this
module stays importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Final

import msgspec

from ascend_dist.common.errors import (
    ConfigError,
    IncompatiblePeer,
    MessageTooLarge,
    ProtocolError,
    format_allowed,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DTYPE_NAMES",
    "IPC_HANDLE_VERSION",
    "MAX_IPC_HANDLE_BYTES",
    "IpcHandle",
    "decode_ipc_handle",
    "dtype_from_str",
    "dtype_to_str",
    "encode_ipc_handle",
    "strided_extent",
]

IPC_HANDLE_VERSION: Final[int] = 1
"""Version of the `IpcHandle` layout; a handle of another version is refused."""

MAX_IPC_HANDLE_BYTES: Final[int] = 64 * 1024
"""Largest encoded handle `decode_ipc_handle` accepts (a real one is a few hundred bytes)."""

DTYPE_NAMES: Final[tuple[str, ...]] = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
)
"""dtype names an `IpcHandle` may carry (the attribute names in the ``torch`` namespace)."""

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class IpcHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Everything another process needs to map a tensor's memory.

    Attributes:
        version: Layout version, `IPC_HANDLE_VERSION` when created.
        backend: Backend that created the handle (``cpu``, ``cuda`` or ``npu``); only a runtime
            of the same backend can open it.
        payload: Backend-specific bytes (segment name, or encoded storage-sharing parts).
        offset: Byte offset of the tensor's first element inside the shared allocation.
        nbytes: Size in bytes of the shared allocation (segment or storage).
        dtype: Element type, one of `DTYPE_NAMES`.
        shape: Tensor shape, in elements.
        stride: Tensor strides, in elements.
        device_index: Device of the creating process.
    """

    version: int
    backend: str
    payload: bytes
    offset: _NonNegative
    nbytes: _NonNegative
    dtype: str
    shape: tuple[_NonNegative, ...]
    stride: tuple[_NonNegative, ...]
    device_index: _NonNegative


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(IpcHandle)


def strided_extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Number of elements a strided view spans from its first element (0 for an empty view).

    Args:
        shape: Sizes per dimension.
        stride: Strides per dimension, in elements (same length as ``shape``).

    Returns:
        ``1 + sum((size - 1) * stride)``, or 0 when any size is 0.
    """
    if any(size == 0 for size in shape):
        return 0
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))


def encode_ipc_handle(handle: IpcHandle) -> bytes:
    """Encode a handle as msgpack.

    Args:
        handle: The handle to send.

    Returns:
        The msgpack bytes.
    """
    return _ENCODER.encode(handle)


def _check_handle(handle: IpcHandle) -> None:
    """Reject a decoded handle whose fields are inconsistent."""
    if handle.version != IPC_HANDLE_VERSION:
        raise IncompatiblePeer("IpcHandle.version", IPC_HANDLE_VERSION, handle.version)
    if handle.dtype not in DTYPE_NAMES:
        raise ProtocolError(f"IpcHandle.dtype={handle.dtype!r} is not one of {format_allowed(DTYPE_NAMES)}")
    if len(handle.shape) != len(handle.stride):
        raise ProtocolError(f"IpcHandle.shape {handle.shape} and IpcHandle.stride {handle.stride} differ in length")


def decode_ipc_handle(data: bytes) -> IpcHandle:
    """Decode and check a handle received from another process.

    Args:
        data: Bytes produced by `encode_ipc_handle`.

    Returns:
        The handle.

    Raises:
        MessageTooLarge: ``data`` exceeds `MAX_IPC_HANDLE_BYTES`; it was not decoded.
        IncompatiblePeer: The handle has another `IPC_HANDLE_VERSION`.
        ProtocolError: ``data`` is not a well-formed handle.
    """
    if len(data) > MAX_IPC_HANDLE_BYTES:
        raise MessageTooLarge(f"IPC handle of {len(data)} bytes exceeds the {MAX_IPC_HANDLE_BYTES}-byte bound")
    try:
        handle = _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable IPC handle ({len(data)} bytes): {exc}") from exc
    _check_handle(handle)
    return handle


def dtype_to_str(dtype: torch.dtype) -> str:
    """Name a torch dtype for an `IpcHandle`.

    Args:
        dtype: A torch dtype.

    Returns:
        Its name in the ``torch`` namespace, e.g. ``"bfloat16"``.

    Raises:
        ConfigError: The dtype is not in `DTYPE_NAMES`.
    """
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ConfigError("dtype", dtype, f"one of {format_allowed(DTYPE_NAMES)}")
    return name


def dtype_from_str(name: str) -> torch.dtype:
    """Turn an `IpcHandle` dtype name back into a torch dtype.

    Args:
        name: One of `DTYPE_NAMES`.

    Returns:
        The torch dtype.

    Raises:
        ConfigError: ``name`` is not a known dtype, or this torch lacks it.
    """
    if name not in DTYPE_NAMES:
        raise ConfigError("dtype", name, f"one of {format_allowed(DTYPE_NAMES)}")
    from ascend_dist.common.device.detect import prepare_torch_import

    prepare_torch_import()
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("dtype", name, f"a dtype this torch ({torch.__version__}) provides")
    return dtype
