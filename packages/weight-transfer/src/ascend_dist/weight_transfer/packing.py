"""Packing named tensors into fixed-size buffers and back.

Runs in: trainer (pack) and inference worker (unpack). Planning is pure; pack/unpack touch torch.

Layout: the byte images of the manifest's tensors (each tensor contiguous, row-major, reinterpreted
as bytes) are concatenated in manifest order into one logical byte stream with no header and no
padding. The stream is cut into buffers of exactly ``buffer_size_bytes`` (the last may be shorter):
buffer ``k`` holds stream bytes ``[k * B, (k + 1) * B)``. A tensor may therefore span buffers, and
one larger than a buffer spans several, so any model fits any buffer size; a 0-dim tensor is one
element; an empty tensor is zero bytes. Unlike upstream's "overshoot" rule, buffers never exceed
``B``, so they can be allocated once and reused, and both sides derive the cut points from the
manifest alone.

Unpacking copies each piece into a staging tensor's byte view, so no reinterpretation of a
misaligned slice ever happens (upstream fails on a bf16-odd-numel then fp32 chunk).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ascend_dist.common.device.ipc import dtype_from_str, dtype_to_str
from ascend_dist.weight_transfer.errors import ManifestMismatch
from ascend_dist.weight_transfer.messages import Manifest, TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUCKET_ALIGN",
    "Bucket",
    "LazyImages",
    "Piece",
    "StreamPlan",
    "Unit",
    "as_bytes",
    "dtype_itemsize",
    "expect_end",
    "next_tensor",
    "new_staging",
    "bucket_views",
    "direct_image",
    "pack_bucket",
    "pack_images",
    "pull_bucket",
    "pack_buffer",
    "plan_buckets",
    "plan_stream",
    "check_tensor",
    "copy_bytes",
    "spec_nbytes",
    "staging_images",
    "tensor_views",
    "unpack_buffer",
]

_DTYPES: dict[str, torch.dtype] = {}


def _dtype(name: str) -> torch.dtype:
    """``dtype_from_str`` cached: it is called per tensor on every update, and checks the environment."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = _DTYPES[name] = dtype_from_str(name)
    return dtype


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (``"bfloat16"`` -> 2)."""
    return _dtype(dtype).itemsize


def spec_nbytes(spec: TensorSpec) -> int:
    """Bytes of a tensor's image: ``prod(shape) * itemsize`` (``prod(()) == 1`` for a scalar)."""
    return math.prod(spec.shape) * dtype_itemsize(spec.dtype)


@dataclass(frozen=True)
class Piece:
    """Part of one tensor inside one buffer.

    ``length`` bytes from ``tensor_offset`` of tensor ``tensor_index`` live at ``buffer_offset``.
    """

    tensor_index: int
    tensor_offset: int
    buffer_offset: int
    length: int


@dataclass(frozen=True)
class Unit:
    """One collective of an update: stream bytes ``[start, end)``.

    ``direct`` units are a single large tensor sent from (and received into) its own memory; the
    others are packed: their pieces are copied into a pipeline buffer of at most ``buffer_size``.
    """

    start: int
    end: int
    direct: bool


@dataclass(frozen=True)
class StreamPlan:
    """Where every tensor of a manifest lies in the byte stream, and the collectives that carry it.

    Attributes:
        offsets: Stream offset of each tensor.
        sizes: Byte size of each tensor.
        total_bytes: Length of the stream.
        buffer_size: Bytes per packed buffer.
        units: The collectives, in order; contiguous and covering the stream exactly once.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total_bytes: int
    buffer_size: int
    units: tuple[Unit, ...]

    @property
    def num_buffers(self) -> int:
        """Collectives the stream is cut into (0 for an empty stream)."""
        return len(self.units)

    def buffer_length(self, index: int) -> int:
        """Payload bytes of unit ``index``."""
        unit = self.units[index]
        return unit.end - unit.start

    def unit_start(self, index: int) -> int:
        """Stream offset of unit ``index``."""
        return self.units[index].start

    def pieces(self, index: int) -> Iterator[Piece]:
        """The tensor pieces of unit ``index``, in stream order (zero-byte tensors skipped)."""
        unit = self.units[index]
        start, end = unit.start, unit.end
        first = _first_tensor_at(self.offsets, self.sizes, start)
        for t in range(first, len(self.offsets)):
            lo, size = self.offsets[t], self.sizes[t]
            if lo >= end:
                break
            if size == 0:
                continue
            a, b = max(lo, start), min(lo + size, end)
            if a < b:
                yield Piece(t, a - lo, a - start, b - a)


def _first_tensor_at(offsets: tuple[int, ...], sizes: tuple[int, ...], position: int) -> int:
    """Index of the first tensor whose image ends after ``position`` (binary search)."""
    lo, hi = 0, len(offsets)
    while lo < hi:
        mid = (lo + hi) // 2
        if offsets[mid] + sizes[mid] <= position:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _units(offsets: list[int], sizes: tuple[int, ...], buffer_size: int, direct_threshold: int) -> tuple[Unit, ...]:
    """Cut the stream into collectives.

    Each tensor of at least ``direct_threshold`` bytes (0: none) is a direct unit of its own; every
    run of smaller tensors is cut into packed units of ``buffer_size`` bytes.
    """
    units: list[Unit] = []
    run_start: int | None = None

    def flush(a: int, b: int) -> None:
        for s in range(a, b, buffer_size):
            units.append(Unit(s, min(s + buffer_size, b), False))

    for offset, size in zip(offsets, sizes, strict=True):
        if direct_threshold and size >= direct_threshold:
            if run_start is not None:
                flush(run_start, offset)
                run_start = None
            units.append(Unit(offset, offset + size, True))
        elif run_start is None:
            run_start = offset
    total = offsets[-1] + sizes[-1] if offsets else 0
    if run_start is not None:
        flush(run_start, total)
    return tuple(units)


def plan_stream(manifest: Manifest) -> StreamPlan:
    """Compute the stream layout and its collectives (the same result in every process)."""
    sizes = tuple(spec_nbytes(s) for s in manifest.tensors)
    offsets: list[int] = []
    running = 0
    for size in sizes:
        offsets.append(running)
        running += size
    units = _units(offsets, sizes, manifest.buffer_size_bytes, manifest.direct_threshold_bytes)
    return StreamPlan(tuple(offsets), sizes, running, manifest.buffer_size_bytes, units)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's row-major image as a flat uint8 tensor (a view when already contiguous)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy equal-length uint8 ranges; on the CPU a plain single-threaded memcpy via numpy.

    torch's CPU ``copy_`` splits even small copies across its intra-op threads; on a busy host
    every split pays a thread wake-up (measured: 20 ms per 50 KB copy at load 9 on 2 cores, 200x
    slower than memcpy), which would dominate packing.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        dst.numpy()[...] = src.numpy()
    else:
        dst.copy_(src)


def check_tensor(spec: TensorSpec, name: str, tensor: torch.Tensor, index: int) -> None:
    """Raise `ManifestMismatch` if ``(name, tensor)`` is not what the manifest declares at ``index``."""
    got = (name, dtype_to_str(tensor.dtype), tuple(tensor.shape))
    want = (spec.name, spec.dtype, spec.shape)
    if got != want:
        raise ManifestMismatch(
            f"tensor #{index} of the update: the manifest declares {want!r}, the source yielded {got!r}"
        )


def pack_buffer(plan: StreamPlan, index: int, images: list[torch.Tensor | None], out: torch.Tensor) -> int:
    """Copy the pieces of buffer ``index`` from the tensors' byte images into ``out``.

    Args:
        plan: The stream plan.
        index: Buffer index.
        images: Byte images (`as_bytes`) by tensor index; entries for tensors in this buffer must be set.
        out: A uint8 buffer of at least ``plan.buffer_length(index)`` bytes.

    Returns:
        The payload length written.
    """
    for piece in plan.pieces(index):
        image = images[piece.tensor_index]
        assert image is not None, "pack_buffer called before the tensor's image was taken"
        copy_bytes(
            out[piece.buffer_offset : piece.buffer_offset + piece.length],
            image[piece.tensor_offset : piece.tensor_offset + piece.length],
        )
    return plan.buffer_length(index)


def new_staging(manifest: Manifest, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Allocate one uninitialised tensor per manifest entry (the worker's staging area)."""
    import torch

    return [torch.empty(s.shape, dtype=_dtype(s.dtype), device=device) for s in manifest.tensors]


def tensor_views(flat: torch.Tensor, plan: StreamPlan, manifest: Manifest) -> list[torch.Tensor]:
    """The manifest's tensors as views of a received byte stream ``flat``.

    A tensor whose stream offset is a multiple of its element size is a zero-copy view; a
    misaligned one (after an odd-length bf16, say) is cloned first, since a wider dtype cannot view
    a misaligned slice. Views alias ``flat``: keep it alive while they are used.
    """
    out: list[torch.Tensor] = []
    base = flat.data_ptr()
    for spec, offset, size in zip(manifest.tensors, plan.offsets, plan.sizes, strict=True):
        dtype = _dtype(spec.dtype)
        piece = flat[offset : offset + size]
        if (base + offset) % dtype.itemsize:
            piece = piece.clone()
        out.append(piece.view(dtype).reshape(spec.shape))
    return out


def staging_images(staging: list[torch.Tensor]) -> list[torch.Tensor]:
    """Writable byte views of staging tensors (they are freshly allocated, hence contiguous)."""
    import torch

    return [t.reshape(-1).view(torch.uint8) for t in staging]


def unpack_buffer(plan: StreamPlan, index: int, buffer: torch.Tensor, images: list[torch.Tensor]) -> None:
    """Copy buffer ``index``'s pieces into the staging tensors' byte views ``images``."""
    for piece in plan.pieces(index):
        copy_bytes(
            images[piece.tensor_index][piece.tensor_offset : piece.tensor_offset + piece.length],
            buffer[piece.buffer_offset : piece.buffer_offset + piece.length],
        )


BUCKET_ALIGN = 64
"""Streamed buckets place each tensor at a multiple of this many bytes, so every dtype views it in place."""


@dataclass(frozen=True)
class Bucket:
    """One buffer of a streamed update: whole tensors ``first .. first + len(offsets) - 1``.

    Tensor ``first + i`` lies at byte ``offsets[i]`` of the buffer (a multiple of `BUCKET_ALIGN`; 0
    for a zero-byte tensor, which takes no room); ``length`` is the payload (what is sent; 0 only
    when the whole update has no bytes).
    """

    first: int
    offsets: tuple[int, ...]
    length: int


def plan_buckets(manifest: Manifest) -> tuple[Bucket, ...]:
    """Cut a streamed manifest into buckets of whole tensors, in order, each at most ``buffer_size_bytes``.

    A bucket closes when the next tensor (at its aligned offset) would overflow it. Both sides derive
    the same buckets from the manifest alone.

    Raises:
        ManifestMismatch: A tensor is larger than one buffer (`make_manifest` refuses such manifests
            already; a decoded one is checked again here).
    """
    capacity = manifest.buffer_size_bytes
    buckets: list[Bucket] = []
    first, offsets, end = 0, [], 0
    for index, spec in enumerate(manifest.tensors):
        size = spec_nbytes(spec)
        if size > capacity:
            raise ManifestMismatch(f"tensor {spec.name!r} has {size} bytes, more than one streamed buffer ({capacity})")
        if size == 0:  # no room taken, never opens a bucket (so only a byte-less update has a 0-length one)
            offsets.append(0)
            continue
        at = -(-end // BUCKET_ALIGN) * BUCKET_ALIGN
        if offsets and at + size > capacity:
            buckets.append(Bucket(first, tuple(offsets), end))
            first, offsets, at = index, [], 0
        offsets.append(at)
        end = at + size
    if offsets:
        buckets.append(Bucket(first, tuple(offsets), end))
    return tuple(buckets)


def bucket_views(buffer: torch.Tensor, bucket: Bucket, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a received bucket (aligned, so no copy); they alias ``buffer``."""
    out: list[tuple[str, torch.Tensor]] = []
    for i, offset in enumerate(bucket.offsets):
        spec = manifest.tensors[bucket.first + i]
        size = spec_nbytes(spec)
        out.append((spec.name, buffer[offset : offset + size].view(_dtype(spec.dtype)).reshape(spec.shape)))
    return out


def next_tensor(source: Iterator[tuple[str, torch.Tensor]], manifest: Manifest, index: int) -> tuple[str, torch.Tensor]:
    """The source's next ``(name, tensor)``; `ManifestMismatch` when it ended before the manifest."""
    try:
        return next(source)
    except StopIteration:
        raise ManifestMismatch(
            f"the source ended after {index} tensors but the manifest declares {len(manifest.tensors)}"
        ) from None


def pull_bucket(
    bucket: Bucket, source: Iterator[tuple[str, torch.Tensor]], manifest: Manifest
) -> list[tuple[torch.Tensor, bool]]:
    """``bucket``'s tensors pulled from ``source`` (checked against the manifest) as ``(image, is_view)``.

    ``image`` is the tensor's byte image (`as_bytes`); ``is_view`` says it aliases the source tensor
    (it was contiguous), False when the image is a copy.
    """
    images: list[tuple[torch.Tensor, bool]] = []
    for i in range(len(bucket.offsets)):
        index = bucket.first + i
        name, tensor = next_tensor(source, manifest, index)
        check_tensor(manifest.tensors[index], name, tensor, index)
        images.append((as_bytes(tensor), tensor.is_contiguous()))
    return images


def pack_images(buffer: torch.Tensor, bucket: Bucket, images: list[tuple[torch.Tensor, bool]]) -> None:
    """Copy a bucket's images (from `pull_bucket`) into ``buffer`` at their offsets: one copy per tensor."""
    for offset, (image, _) in zip(bucket.offsets, images, strict=True):
        if image.numel():
            copy_bytes(buffer[offset : offset + image.numel()], image)


def pack_bucket(
    buffer: torch.Tensor, bucket: Bucket, source: Iterator[tuple[str, torch.Tensor]], manifest: Manifest
) -> None:
    """Pull ``bucket``'s tensors from ``source`` (checked against the manifest) into ``buffer`` at their offsets."""
    pack_images(buffer, bucket, pull_bucket(bucket, source, manifest))


def direct_image(bucket: Bucket, images: list[tuple[torch.Tensor, bool]], device: torch.device) -> torch.Tensor | None:
    """The one tensor image that is the whole of ``bucket``'s payload, when it can be broadcast as is.

    That is: the bucket's bytes are a single tensor (zero-byte tensors aside: it then lies at offset
    0 and the payload is exactly its image), the image is a view of the source tensor (no copy, so
    sending from it adds no memory to the bound) and it lives on ``device``. The wire then carries
    the same bytes as a packed bucket would, so the receiver cannot tell the difference. None
    otherwise (pack it).
    """
    full = [(image, is_view) for image, is_view in images if image.numel()]
    if len(full) != 1:
        return None
    image, is_view = full[0]
    if not is_view or image.numel() != bucket.length or image.device != device:
        return None
    return image


def expect_end(source: Iterator[tuple[str, Any]], manifest: Manifest) -> None:
    """Raise `ManifestMismatch` when the source yields more than the manifest declares."""
    extra = next(source, None)
    if extra is not None:
        raise ManifestMismatch(
            f"the source yielded {extra[0]!r} after the {len(manifest.tensors)} tensors the manifest declares"
        )


class LazyImages:
    """Pulls (and checks) source tensors only as the buffers that hold them are packed.

    The trainer never images the whole update: a tensor is read from the source when the first
    buffer holding its bytes is packed, and its image is dropped once the buffers holding it were
    packed (a non-contiguous tensor's image is a copy, so this bounds those copies too).
    """

    def __init__(self, plan: StreamPlan, manifest: Manifest, source: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Serve ``source``'s tensors, checked against ``manifest``, laid out by ``plan``."""
        self._plan = plan
        self._manifest = manifest
        self._source = source
        self.images: list[torch.Tensor | None] = [None] * len(manifest.tensors)
        self._pulled = 0
        self._released = 0

    def _pull_one(self) -> None:
        index = self._pulled
        name, tensor = next_tensor(self._source, self._manifest, index)
        check_tensor(self._manifest.tensors[index], name, tensor, index)
        self.images[index] = as_bytes(tensor)
        self._pulled += 1

    def upto(self, index: int) -> list[torch.Tensor | None]:
        """Images of every tensor starting before the end of unit ``index``; older ones dropped."""
        plan = self._plan
        start = plan.unit_start(index)
        end = start + plan.buffer_length(index)
        while self._pulled < len(self.images) and plan.offsets[self._pulled] < end:
            self._pull_one()
        while self._released < self._pulled and plan.offsets[self._released] + plan.sizes[self._released] <= start:
            self.images[self._released] = None  # fully packed earlier (in-flight sends hold their own ref)
            self._released += 1
        return self.images

    def rest(self) -> None:
        """Pull the remaining (zero-byte) tensors, then require the source to be exhausted."""
        while self._pulled < len(self.images):
            self._pull_one()
        self.images = []
        expect_end(self._source, self._manifest)
