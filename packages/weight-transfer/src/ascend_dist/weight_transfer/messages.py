"""Wire types of weight transfer: the tensor manifest both sides agree on, and IPC chunk messages.

Runs in: trainer and inference-worker processes. Changing a Struct here is a protocol change:
bump `PROTOCOL_VERSION`.

Everything that crosses a process is a frozen msgspec Struct encoded as msgpack (data plane) or
JSON (control plane: vLLM's HTTP/Ray weight-sync routes carry plain dicts). Nothing is pickled.
The manifest is the contract upstream leaves implicit: tensor names, dtypes and shapes in send
order, plus the buffer geometry. The trainer sends its manifest in-band before the first data
buffer; a worker compares it with the one it built from its own update info and refuses (before
writing anything) with a `ManifestMismatch` naming the first difference.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Final

import msgspec

from ascend_dist.common.device.ipc import DTYPE_NAMES, IpcHandle
from ascend_dist.common.errors import ConfigError, IncompatiblePeer, MessageTooLarge, ProtocolError, format_allowed
from ascend_dist.common.hashing import stable_hash
from ascend_dist.weight_transfer.errors import ManifestMismatch

__all__ = [
    "DEFAULT_BUFFER_SIZE_BYTES",
    "DEFAULT_DIRECT_THRESHOLD_BYTES",
    "DEFAULT_NUM_BUFFERS",
    "MAX_MANIFEST_BYTES",
    "PROTOCOL_VERSION",
    "IpcChunk",
    "IpcParams",
    "Manifest",
    "TensorSpec",
    "check_manifests",
    "decode_ipc_chunk",
    "decode_manifest",
    "encode_ipc_chunk",
    "encode_manifest",
    "ipc_chunk_from_builtins",
    "ipc_chunk_to_builtins",
    "make_manifest",
]

PROTOCOL_VERSION: Final[int] = 3
"""2: `Manifest.streamed` (an old peer would ignore the field and misread the bucket layout)."""
DEFAULT_BUFFER_SIZE_BYTES: Final[int] = 1024**3
"""Bytes per pipeline buffer (upstream's 1 GiB default)."""
DEFAULT_NUM_BUFFERS: Final[int] = 2
DEFAULT_DIRECT_THRESHOLD_BYTES: Final[int] = 16 * 1024 * 1024
"""Broadcast engine: tensors of at least 16 MiB are sent from their own memory, not copied into a buffer.

A direct send saves the tensor's copy but costs a collective of its own; it pays once the tensor's
wire time dwarfs a collective's fixed cost. Measured on gloo/loopback (0.3-0.7 ms per collective,
~1-2 GB/s): a 1 MiB threshold (125 extra collectives for a 500-tensor model) was 20-30 % slower
than packing everything; at 16 MiB one collective is a few percent of the tensor's own wire time
on gloo and on HCCL (~0.1 ms launch, ~25 GB/s).
"""
MAX_MANIFEST_BYTES: Final[int] = 64 * 1024 * 1024
"""Largest manifest accepted (a 100k-tensor model encodes to a few MiB)."""

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(gt=0)]


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of an update: its name, dtype name (``torch.<name>``) and shape."""

    name: str
    dtype: str
    shape: tuple[_NonNegative, ...]


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """What one update carries, in send order, and how it is cut into buffers.

    Attributes:
        version: `PROTOCOL_VERSION` of the sender.
        tensors: Every tensor of the update, in the order the trainer sends it.
        buffer_size_bytes: Size of each pipeline buffer; the byte stream is cut every this many bytes.
        num_buffers: Buffers in flight (pipeline depth).
        packed: True when tensors travel packed into buffers, False for one collective per tensor.
        direct_threshold_bytes: Packed mode: a tensor of at least this many bytes is sent from its
            own memory in a collective of its own instead of being copied into a buffer (0: never).
        streamed: Bounded mode: whole tensors travel in buckets of at most ``buffer_size_bytes``
            (`packing.plan_buckets`), and each worker loads a bucket as soon as it lands, so neither
            side holds more than ``num_buffers`` buffers; no tensor may exceed one buffer.
    """

    version: int = PROTOCOL_VERSION
    tensors: tuple[TensorSpec, ...]
    buffer_size_bytes: _Positive = DEFAULT_BUFFER_SIZE_BYTES
    num_buffers: _Positive = DEFAULT_NUM_BUFFERS
    packed: bool = True
    direct_threshold_bytes: _NonNegative = 0
    streamed: bool = False

    def digest(self) -> str:
        """Stable SHA-256 of the encoded manifest (equal manifests, equal digests, in any process)."""
        return stable_hash(encode_manifest(self))


class IpcParams(msgspec.Struct, frozen=True, kw_only=True):
    """The must-agree parameters of the IPC engine, sent by the trainer at init."""

    version: int = PROTOCOL_VERSION
    packed: bool = True
    buffer_size_bytes: _Positive = DEFAULT_BUFFER_SIZE_BYTES
    streamed: bool = False
    """Each chunk is a bucket of whole tensors (`packing.plan_buckets`), loaded when it arrives."""


class IpcChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One IPC update message: a packed chunk of the byte stream, or every tensor unpacked.

    Attributes:
        version: `PROTOCOL_VERSION` of the sender.
        manifest: The whole update's manifest (repeated on every chunk; it is small).
        chunk_index: Index of this chunk in the byte stream (0 when unpacked).
        num_chunks: Chunks in the update (1 when unpacked).
        handles: Packed: one entry, the shared buffer by device uuid. Unpacked: one entry per
            tensor in manifest order, each mapping device uuid to that tensor's handle.
        update_id: The trainer's random id of this update, the same on all its chunks; the workers
            of a replica name their load vote by it (`load_vote`). Empty from a trainer without it:
            those workers then load without a vote.
    """

    version: int = PROTOCOL_VERSION
    manifest: Manifest
    chunk_index: _NonNegative
    num_chunks: _Positive
    handles: tuple[dict[str, IpcHandle], ...]
    update_id: Annotated[str, msgspec.Meta(max_length=64, pattern="^[0-9a-f]*$")] = ""


_MSGPACK_ENCODER: Final = msgspec.msgpack.Encoder()
_MANIFEST_DECODER: Final = msgspec.msgpack.Decoder(Manifest)
_CHUNK_DECODER: Final = msgspec.msgpack.Decoder(IpcChunk)


def make_manifest(
    specs: list[tuple[str, str, tuple[int, ...] | list[int]]],
    *,
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    packed: bool = True,
    direct_threshold_bytes: int = 0,
    streamed: bool = False,
) -> Manifest:
    """Build and validate a manifest from ``(name, dtype name, shape)`` triples.

    Args:
        specs: Tensors in send order; dtype names as in ``torch`` (``"bfloat16"``), shapes in elements.
        buffer_size_bytes: Bytes per pipeline buffer (> 0).
        num_buffers: Buffers in flight (> 0).
        packed: Whether tensors are packed into buffers.
        direct_threshold_bytes: Tensors at least this large skip the buffers (0: none do).
        streamed: Bounded, pipelined buckets loaded as they land (packed only, no direct sends).

    Returns:
        The manifest.

    Raises:
        ConfigError: A dtype is unknown, a dimension negative, a name repeated, or a size not
            positive; streamed and not packed; a streamed tensor larger than one buffer.
    """
    if buffer_size_bytes <= 0:
        raise ConfigError("buffer_size_bytes", buffer_size_bytes, "a positive number of bytes")
    if num_buffers <= 0:
        raise ConfigError("num_buffers", num_buffers, "a positive integer")
    if direct_threshold_bytes < 0:
        raise ConfigError("direct_threshold_bytes", direct_threshold_bytes, "0 (off) or a positive number of bytes")
    if streamed and not packed:
        raise ConfigError("packed", packed, "true for a streamed update (it travels in packed buckets)")
    seen: set[str] = set()
    tensors: list[TensorSpec] = []
    for name, dtype, shape in specs:
        if dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype of {name!r}", dtype, format_allowed(DTYPE_NAMES))
        if any(int(d) < 0 for d in shape):
            raise ConfigError(f"shape of {name!r}", tuple(shape), "non-negative dimensions")
        if name in seen:
            raise ConfigError("tensor name", name, "names unique within one update")
        seen.add(name)
        spec = TensorSpec(name, dtype, tuple(int(d) for d in shape))
        if streamed:
            _check_fits(spec, buffer_size_bytes)
        tensors.append(spec)
    return Manifest(
        tensors=tuple(tensors),
        buffer_size_bytes=buffer_size_bytes,
        num_buffers=num_buffers,
        packed=packed,
        direct_threshold_bytes=0 if streamed else direct_threshold_bytes,
        streamed=streamed,
    )


def _check_fits(spec: TensorSpec, buffer_size_bytes: int) -> None:
    """Refuse a streamed tensor larger than a bucket: the worker would need its whole size to assemble it."""
    from ascend_dist.common.device.ipc import dtype_from_str  # imports torch: only streamed manifests need it

    nbytes = math.prod(spec.shape) * dtype_from_str(spec.dtype).itemsize
    if nbytes > buffer_size_bytes:
        raise ConfigError(
            f"size of tensor {spec.name!r}",
            nbytes,
            f"at most buffer_size_bytes={buffer_size_bytes} in a streamed update (raise the buffer size "
            f"to at least {nbytes}; a bucket holds whole tensors)",
        )


def encode_manifest(manifest: Manifest) -> bytes:
    """Encode a manifest as msgpack."""
    return _MSGPACK_ENCODER.encode(manifest)


def decode_manifest(data: bytes) -> Manifest:
    """Decode a manifest received from the trainer.

    Raises:
        MessageTooLarge: ``data`` exceeds `MAX_MANIFEST_BYTES`.
        IncompatiblePeer: The sender speaks another `PROTOCOL_VERSION`.
        ProtocolError: ``data`` is not a well-formed manifest.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise MessageTooLarge(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        manifest = _MANIFEST_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable manifest ({len(data)} bytes): {exc}") from exc
    if manifest.version != PROTOCOL_VERSION:
        raise IncompatiblePeer("Manifest.version", PROTOCOL_VERSION, manifest.version)
    return manifest


def check_manifests(local: Manifest, remote: Manifest, *, local_role: str, remote_role: str) -> None:
    """Raise `ManifestMismatch` naming the first difference between two manifests.

    Args:
        local: This side's manifest.
        remote: The peer's manifest.
        local_role: How to name this side in the message (``"worker"``).
        remote_role: How to name the peer (``"trainer"``).

    Raises:
        ManifestMismatch: The manifests differ; the message names the field (and the tensor).
    """
    diff = _first_difference(local, remote)
    if diff is not None:
        what, mine, theirs = diff
        raise ManifestMismatch(f"{what}: {local_role} has {mine!r}, {remote_role} has {theirs!r}")


def _first_difference(a: Manifest, b: Manifest) -> tuple[str, object, object] | None:
    for field in ("version", "packed", "streamed", "buffer_size_bytes", "num_buffers", "direct_threshold_bytes"):
        if getattr(a, field) != getattr(b, field):
            return field, getattr(a, field), getattr(b, field)
    for index, (x, y) in enumerate(zip(a.tensors, b.tensors, strict=False)):
        if x.name != y.name:
            return f"name of tensor #{index}", x.name, y.name
        if x.dtype != y.dtype:
            return f"dtype of tensor {x.name!r}", x.dtype, y.dtype
        if x.shape != y.shape:
            return f"shape of tensor {x.name!r}", x.shape, y.shape
    if len(a.tensors) != len(b.tensors):
        shorter, longer = sorted((a.tensors, b.tensors), key=len)
        extra = longer[len(shorter)].name
        return f"tensor count (first unmatched {extra!r})", len(a.tensors), len(b.tensors)
    return None


def encode_ipc_chunk(chunk: IpcChunk) -> bytes:
    """Encode an IPC chunk message as msgpack."""
    return _MSGPACK_ENCODER.encode(chunk)


def decode_ipc_chunk(data: bytes) -> IpcChunk:
    """Decode an IPC chunk message.

    Raises:
        IncompatiblePeer: The sender speaks another `PROTOCOL_VERSION`.
        ProtocolError: ``data`` is not a well-formed chunk.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise MessageTooLarge(f"IPC chunk of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        chunk = _CHUNK_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable IPC chunk ({len(data)} bytes): {exc}") from exc
    if chunk.version != PROTOCOL_VERSION:
        raise IncompatiblePeer("IpcChunk.version", PROTOCOL_VERSION, chunk.version)
    return chunk


def ipc_chunk_to_builtins(chunk: IpcChunk) -> dict[str, Any]:
    """JSON-safe dict of a chunk (bytes become base64 strings), for HTTP/Ray control planes."""
    out = msgspec.to_builtins(chunk)
    assert isinstance(out, dict)
    return out


def ipc_chunk_from_builtins(data: dict[str, Any]) -> IpcChunk:
    """Inverse of `ipc_chunk_to_builtins`, strict.

    Raises:
        ProtocolError: The dict is not a well-formed chunk.
        IncompatiblePeer: The sender speaks another `PROTOCOL_VERSION`.
    """
    try:
        chunk = msgspec.convert(data, IpcChunk, from_attributes=False)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed IPC chunk: {exc}") from exc
    if chunk.version != PROTOCOL_VERSION:
        raise IncompatiblePeer("IpcChunk.version", PROTOCOL_VERSION, chunk.version)
    return chunk
