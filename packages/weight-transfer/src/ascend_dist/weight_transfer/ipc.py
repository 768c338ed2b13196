"""Same-chip IPC pieces shared by the trainer and the worker: device identity, handles, chunking.

Runs in: trainer processes (export, merge, pack) and inference workers (pick, rewrite, open).

Device identity: ``"<ip>-<physical chip>"`` on npu/cuda (the chip is the logical index's entry of
``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` when set), ``"<ip>-cpu<index>"`` on the
CPU simulation. A worker picks the handle of its own identity and rewrites its device index to its
own before opening. Handles are `ascend_dist.common.device.IpcHandle` Structs: shared memory on the
CPU, torch's storage-sharing parts on npu/cuda; they travel as msgpack or JSON, never pickle.

Packed mode reuses one exported buffer: chunk ``k`` of the update's byte stream (`packing`) is
copied into it, the device is synchronised, and the chunk's handle is yielded; the producer must
not be resumed until every consumer has finished the chunk (the trainer engine ensures it).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from ascend_dist.common.device.ipc import IpcHandle
from ascend_dist.common.errors import ConfigError, DeviceError, ProtocolError
from ascend_dist.weight_transfer.messages import IpcChunk, Manifest
from ascend_dist.weight_transfer.packing import (
    LazyImages,
    StreamPlan,
    check_tensor,
    expect_end,
    next_tensor,
    pack_bucket,
    pack_buffer,
    plan_buckets,
    plan_stream,
)

if TYPE_CHECKING:
    import torch

    from ascend_dist.common.device import DeviceRuntime

__all__ = [
    "HandleExchange",
    "LocalExchange",
    "SharedExporter",
    "device_uuid",
    "local_ip",
    "merge_handles",
    "bucket_chunks",
    "packed_chunks",
    "pick_handle",
    "unpacked_chunk",
]

logger = logging.getLogger(__name__)

_VISIBLE_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}


@functools.cache
def local_ip() -> str:
    """The IP of the default route (a UDP "connect", no packet sent); the host name's IP as fallback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def device_uuid(logical_index: int, backend: str, *, ip: str | None = None, visible: str | None = None) -> str:
    """Identity of a chip, equal in every process using it.

    Args:
        logical_index: The process's device index.
        backend: ``"npu"``, ``"cuda"`` or ``"cpu"``.
        ip: Host IP; defaults to `local_ip`.
        visible: Visible-devices list; defaults to the backend's env var.

    Raises:
        ConfigError: The logical index is outside the visible-devices list, or the backend unknown.
    """
    host = ip if ip is not None else local_ip()
    if backend == "cpu":
        return f"{host}-cpu{logical_index}"
    if backend not in _VISIBLE_ENV:
        raise ConfigError("backend", backend, "npu, cuda or cpu")
    listing = visible if visible is not None else os.environ.get(_VISIBLE_ENV[backend])
    if listing:
        chips = [c.strip() for c in listing.split(",") if c.strip()]
        if not 0 <= logical_index < len(chips):
            raise ConfigError(
                "logical device index", logical_index, f"0..{len(chips) - 1} ({_VISIBLE_ENV[backend]}={listing})"
            )
        return f"{host}-{chips[logical_index]}"
    return f"{host}-{logical_index}"


def merge_handles(per_rank: Sequence[Sequence[dict[str, IpcHandle]]]) -> list[dict[str, IpcHandle]]:
    """Union, entry by entry, of every trainer rank's handle list (one chip per rank).

    Raises:
        ProtocolError: Ranks exported different numbers of entries.
        ConfigError: Two ranks claim the same chip.
    """
    if not per_rank:
        return []
    count = len(per_rank[0])
    merged: list[dict[str, IpcHandle]] = [{} for _ in range(count)]
    for rank, handles in enumerate(per_rank):
        if len(handles) != count:
            raise ProtocolError(f"trainer rank {rank} exported {len(handles)} handles, rank 0 exported {count}")
        for entry, handle_map in zip(merged, handles, strict=True):
            for uuid, handle in handle_map.items():
                if uuid in entry:
                    raise ConfigError("device uuid", uuid, "one trainer rank per chip (two ranks exported it)")
                entry[uuid] = handle
    return merged


def pick_handle(handles: dict[str, IpcHandle], uuid: str, device_index: int) -> IpcHandle:
    """This worker's handle, rewritten for its own device index.

    Raises:
        ConfigError: No handle for ``uuid``: trainer and worker are not on the same chip.
    """
    handle = handles.get(uuid)
    if handle is None:
        raise ConfigError(
            "device uuid", uuid,
            f"one of {sorted(handles)} (IPC needs the trainer and the worker on the same chip)",
        )  # fmt: skip
    return msgspec.structs.replace(handle, device_index=device_index)


class HandleExchange(Protocol):
    """All-gather of bytes among the colocated trainer ranks, plus a barrier."""

    rank: int
    world_size: int

    def all_gather(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload``, by rank."""
        ...

    def barrier(self) -> None:
        """Block until every trainer rank arrived."""
        ...


class LocalExchange:
    """`HandleExchange` of a single trainer rank."""

    rank = 0
    world_size = 1

    def all_gather(self, payload: bytes) -> list[bytes]:
        """Just ``[payload]``."""
        return [payload]

    def barrier(self) -> None:
        """Nothing to wait for."""


class SharedExporter:
    """Exports tensors through a runtime: shared memory on the CPU, device IPC on npu/cuda.

    On the CPU, private tensors are copied into shared segments that are kept per tensor name and
    reused by later updates of the same shape (so a long run does not pile up segments); the
    packed buffer is likewise allocated once.
    """

    def __init__(self, runtime: DeviceRuntime, uuid: str) -> None:
        """Export with ``runtime`` under device identity ``uuid``."""
        self.runtime = runtime
        self.uuid = uuid
        self._copies: dict[str, torch.Tensor] = {}
        self._buffer: torch.Tensor | None = None

    def empty(self, nbytes: int) -> torch.Tensor:
        """A new shareable uint8 buffer of ``nbytes``."""
        import torch

        empty_shared = getattr(self.runtime, "empty_shared", None)
        if empty_shared is not None:  # the CPU simulation: only shared-memory tensors can be exported
            return empty_shared((nbytes,), torch.uint8)
        return self.runtime.empty((nbytes,), torch.uint8)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The reusable packed buffer, at least ``nbytes`` long (grown when needed)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = self.empty(nbytes)
        return self._buffer[:nbytes]

    def share(self, name: str, tensor: torch.Tensor) -> tuple[IpcHandle, torch.Tensor]:
        """A handle of ``tensor``'s contiguous image and the tensor that must stay alive while it is used."""
        try:
            shared = tensor.detach().contiguous()
            return self.runtime.ipc_handle(shared), shared
        except DeviceError:  # private CPU memory: copy it into a (reused) shared segment
            copy = self._copies.get(name)
            if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                copy = self.empty(tensor.numel() * tensor.element_size()).view(tensor.dtype).view(tensor.shape)
                self._copies[name] = copy
            copy.copy_(tensor)
            return self.runtime.ipc_handle(copy), copy


def unpacked_chunk(
    exporter: SharedExporter, manifest: Manifest, tensors: Iterable[tuple[str, torch.Tensor]]
) -> tuple[list[dict[str, IpcHandle]], list[torch.Tensor]]:
    """One handle per tensor (``{}`` for zero-byte tensors) and the tensors to keep alive."""
    handles: list[dict[str, IpcHandle]] = []
    keep: list[torch.Tensor] = []
    source = iter(tensors)
    for index, spec in enumerate(manifest.tensors):
        item = next(source, None)
        if item is None:
            raise ConfigError("tensors", f"{index} tensors", f"the {len(manifest.tensors)} the manifest declares")
        check_tensor(spec, item[0], item[1], index)
        if item[1].numel() == 0:
            handles.append({})
            continue
        handle, alive = exporter.share(spec.name, item[1])
        handles.append({exporter.uuid: handle})
        keep.append(alive)
    return handles, keep


def packed_chunks(
    exporter: SharedExporter, manifest: Manifest, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[int, dict[str, IpcHandle]]]:
    """Fill one reused shared buffer with each chunk of the byte stream and yield its handle.

    Yields:
        ``(chunk index, {uuid: handle of the chunk's bytes})``; resume only after every consumer
        finished with the chunk.
    """
    plan: StreamPlan = plan_stream(manifest)
    if plan.num_buffers == 0:
        return
    buffer = exporter.buffer(min(plan.buffer_size, plan.total_bytes))
    lazy = LazyImages(plan, manifest, iter(tensors))  # each tensor read when its first chunk is packed
    for k in range(plan.num_buffers):
        length = pack_buffer(plan, k, lazy.upto(k), buffer)
        exporter.runtime.synchronize()
        yield k, {exporter.uuid: exporter.runtime.ipc_handle(buffer[:length])}
    lazy.rest()


def bucket_chunks(
    exporter: SharedExporter, manifest: Manifest, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[int, dict[str, IpcHandle]]]:
    """Streamed: fill one reused shared buffer with each bucket of whole tensors and yield its handle.

    Each tensor is read from the source when its bucket is packed. An update without bytes yields
    nothing (the caller sends one empty message, as for packed updates).

    Yields:
        ``(bucket index, {uuid: handle of the bucket's bytes})``; resume only after every consumer
        finished with (loaded) the bucket.
    """
    buckets = plan_buckets(manifest)
    if not any(b.length for b in buckets):
        source = iter(tensors)
        for index, spec in enumerate(manifest.tensors):
            name, tensor = next_tensor(source, manifest, index)
            check_tensor(spec, name, tensor, index)
        expect_end(source, manifest)
        return
    buffer = exporter.buffer(max(b.length for b in buckets))
    source = iter(tensors)
    for k, bucket in enumerate(buckets):
        pack_bucket(buffer, bucket, source, manifest)
        exporter.runtime.synchronize()
        yield k, {exporter.uuid: exporter.runtime.ipc_handle(buffer[: bucket.length])}
    expect_end(source, manifest)


def make_chunk(
    manifest: Manifest, index: int, count: int, handles: Sequence[dict[str, IpcHandle]], update_id: str = ""
) -> IpcChunk:
    """Build an `IpcChunk` message (``update_id``: the same random hex id on every chunk of one update)."""
    return IpcChunk(manifest=manifest, chunk_index=index, num_chunks=count, handles=tuple(handles), update_id=update_id)
