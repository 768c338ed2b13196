"""Trainer side of the same-chip IPC engine (backend ``npu_ipc``); needs torch, never vLLM.

Runs in: every colocated trainer rank (one per chip). Call order:

    trainer = IpcTrainer(client, runtime, packed=True, buffer_size_bytes=...)
    trainer.init()                      # the sender tells the workers the must-agree parameters
    trainer.send(model.named_parameters())   # start, update(s), finish through the client

Every rank exports its own copy and the handles are merged across ranks through a
`HandleExchange`, so each worker finds its own chip's entry; only rank 0 (the sender) talks to the
client. Packed mode reuses one buffer: after each chunk the sender's ``update_weights`` returns
only once the workers have copied it, and a gather of its outcome holds the other ranks until
then, so no rank overwrites its buffer while its worker still reads it.

The ranks move in lockstep: each exchange carries either a rank's handles / outcome or the error
it just raised, so a failure on any rank (the sender's RPC, another rank's source) reaches every
rank at the next exchange: the failing rank raises its own error, the others `UpdateAborted`
naming it. Nothing waits for a rank that has already given up.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from ascend_dist.common.device.ipc import IpcHandle
from ascend_dist.common.errors import ProtocolError
from ascend_dist.weight_transfer.errors import UpdateAborted
from ascend_dist.weight_transfer.ipc import (
    HandleExchange,
    LocalExchange,
    SharedExporter,
    bucket_chunks,
    device_uuid,
    make_chunk,
    merge_handles,
    packed_chunks,
    unpacked_chunk,
)
from ascend_dist.weight_transfer.messages import (
    DEFAULT_BUFFER_SIZE_BYTES,
    IpcChunk,
    IpcParams,
    Manifest,
    ipc_chunk_to_builtins,
)
from ascend_dist.weight_transfer.packing import plan_buckets, plan_stream
from ascend_dist.weight_transfer.trainer import manifest_of

if TYPE_CHECKING:
    import torch

    from ascend_dist.common.device import DeviceRuntime

__all__ = ["IpcTrainer", "TorchDistExchange", "WeightSyncClient"]

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()


class _Step(msgspec.Struct, frozen=True):
    """One rank's part of a lockstep exchange: its handles, or the error it raised (then no handles)."""

    error: str = ""
    handles: list[dict[str, IpcHandle]] = msgspec.field(default_factory=list)


_STEP = msgspec.msgpack.Decoder(_Step)


@runtime_checkable
class WeightSyncClient(Protocol):
    """The inference side's weight-sync control plane (vLLM's ``VLLMWeightSyncClient`` shape)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Initialise every worker's engine."""
        ...

    def start_weight_update(self) -> None:
        """Open an update on every worker."""
        ...

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Deliver one update message to every worker; returns when they applied it."""
        ...

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Close the update on every worker."""
        ...


class TorchDistExchange:
    """`HandleExchange` over an initialised torch.distributed group of the trainer ranks (gloo or device)."""

    def __init__(self, group: Any = None, device: Any = None) -> None:  # a torch ProcessGroup / torch.device
        """Use ``group`` (None: the default group).

        ``device``: where the gathered byte tensors live; None: the CPU when the group's backend has
        gloo, else the current accelerator (an HCCL/NCCL-only group gathers device tensors only).
        """
        import torch
        import torch.distributed as dist

        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            backend = str(dist.get_backend(group)).lower()
            device = "cpu" if "gloo" in backend else torch.accelerator.current_accelerator()
        self._device = torch.device(device)

    def all_gather(self, payload: bytes) -> list[bytes]:
        """Gather variable-length bytes: lengths first, then padded payloads (no pickle)."""
        import torch
        import torch.distributed as dist

        dev = self._device
        length = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
        lengths = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self.world_size)]
        dist.all_gather(lengths, length, group=self._group)
        longest = max(int(x.item()) for x in lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else mine[:0]
        gathered = [torch.zeros(longest, dtype=torch.uint8, device=dev) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine.to(dev), group=self._group)
        return [g[: int(n.item())].cpu().numpy().tobytes() for g, n in zip(gathered, lengths, strict=True)]

    def barrier(self) -> None:
        """torch.distributed barrier on the group."""
        import torch.distributed as dist

        dist.barrier(group=self._group)


class IpcTrainer:
    """Shares weights with colocated inference workers through IPC handles."""

    def __init__(
        self,
        client: WeightSyncClient,
        runtime: DeviceRuntime,
        *,
        packed: bool = True,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        uuid: str | None = None,
        exchange: HandleExchange | None = None,
        streamed: bool = False,
    ) -> None:
        """Create the engine.

        Args:
            client: The control plane (called only on the sender, rank 0 of ``exchange``).
            runtime: Exports tensors (shared memory on the CPU).
            packed: Pack into one reused buffer (bounded memory) or share every tensor.
            buffer_size_bytes: Packed buffer size; any tensor size works (tensors span chunks).
            uuid: This rank's chip identity; default `device_uuid` of the runtime's device.
            exchange: The colocated trainer ranks; default a single rank.
            streamed: Packed chunks are buckets of whole tensors, each loaded by the workers when
                it arrives (no staging on the workers; a tensor larger than the buffer is refused).
        """
        self.client = client
        self.exchange: HandleExchange = exchange if exchange is not None else LocalExchange()
        self.params = IpcParams(packed=packed, buffer_size_bytes=buffer_size_bytes, streamed=streamed)
        uid = uuid if uuid is not None else device_uuid(runtime.device_index, runtime.name)
        self.exporter = SharedExporter(runtime, uid)

    @property
    def is_sender(self) -> bool:
        """Whether this rank drives the client (rank 0)."""
        return self.exchange.rank == 0

    def init(self) -> None:
        """Send the must-agree parameters to the workers (sender only)."""
        if self.is_sender:
            params = msgspec.to_builtins(self.params)
            if not self.params.streamed:  # the payload of a staged trainer stays what it was
                del params["streamed"]
            self.client.init_weight_transfer_engine(params)

    def _step(
        self, what: str, handles: list[dict[str, IpcHandle]], failure: BaseException | None
    ) -> list[list[dict[str, IpcHandle]]]:
        """Exchange this rank's handles (or its ``failure``) with every rank; every rank raises on any failure.

        Raises:
            BaseException: ``failure`` itself, on the rank that raised it.
            UpdateAborted: Another trainer rank failed (named, with its error).
            ProtocolError: A rank sent something undecodable.
        """
        if self.exchange.world_size == 1:
            if failure is not None:
                raise failure
            return [handles]
        error = f"{type(failure).__name__}: {failure}" if failure is not None else ""
        gathered = self.exchange.all_gather(_ENCODER.encode(_Step(error, handles if failure is None else [])))
        if failure is not None:
            raise failure
        try:
            steps = [_STEP.decode(raw) for raw in gathered]
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"undecodable exchange from a trainer rank: {exc}") from exc
        failed = [(rank, step.error) for rank, step in enumerate(steps) if step.error]
        if failed:
            rank, why = failed[0]
            raise UpdateAborted(f"trainer rank {rank} failed {what}: {why}; this rank stopped too")
        return [step.handles for step in steps]

    def _merged(
        self, handles: list[dict[str, IpcHandle]], failure: BaseException | None = None
    ) -> list[dict[str, IpcHandle]]:
        per_rank = self._step("exporting its weights", handles, failure)
        return per_rank[0] if len(per_rank) == 1 else merge_handles(per_rank)

    def _call(self, what: str, call: Any) -> None:  # Callable[[], object]: the sender's client call
        """The sender runs ``call``; every rank learns its outcome (no rank reuses memory before it returned)."""
        failure: BaseException | None = None
        if self.is_sender:
            try:
                call()
            except Exception as exc:
                failure = exc
        self._step(f"the engines' {what}", [], failure)

    def _deliver(self, chunk: IpcChunk) -> None:
        self._call("update_weights", lambda: self.client.update_weights({"chunk": ipc_chunk_to_builtins(chunk)}))

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest | None = None) -> int:
        """Run one full update round (start, update(s), finish) on every rank.

        Args:
            tensors: ``(name, tensor)`` in send order, the same on every rank.
            manifest: The update's manifest; built from ``tensors`` when None.

        Returns:
            Number of update messages sent.

        Raises:
            UpdateAborted: Another trainer rank failed (its rank and error are named); this rank
                stopped at the same exchange.
            Exception: This rank's own failure (the sender: the client's error), after every rank
                was told; finish is then not called.
        """
        if manifest is None:
            tensors = list(tensors)
            manifest = manifest_of(
                tensors, packed=self.params.packed, buffer_size_bytes=self.params.buffer_size_bytes, num_buffers=1,
                streamed=self.params.streamed,
            )  # fmt: skip
        self._call("start_weight_update", self.client.start_weight_update)
        update_id = secrets.token_hex(16)  # names the workers' load vote; only the sender's reaches them
        sent = 0
        if manifest.packed:
            if manifest.streamed:
                buckets = plan_buckets(manifest)
                count = len(buckets) if any(b.length for b in buckets) else 0
                chunks = bucket_chunks(self.exporter, manifest, tensors)
            else:
                count = plan_stream(manifest).num_buffers
                chunks = packed_chunks(self.exporter, manifest, tensors)
            while True:
                try:  # a rank's source failing mid-way joins the exchange with its error instead of leaving
                    item = next(chunks, None)
                except Exception as exc:
                    self._merged([], exc)
                    raise  # not reached: _merged raises exc on this rank
                if item is None:
                    break
                index, handle = item
                self._deliver(make_chunk(manifest, index, count, self._merged([handle]), update_id))
                sent += 1
            if count == 0:  # an update without bytes: one message so the workers still load nothing
                self._deliver(make_chunk(manifest, 0, 1, self._merged([{}]), update_id))
                sent += 1
        else:
            try:
                handles, keep = unpacked_chunk(self.exporter, manifest, tensors)
            except Exception as exc:
                self._merged([], exc)
                raise  # not reached: _merged raises exc on this rank
            self._deliver(make_chunk(manifest, 0, 1, self._merged(handles), update_id))
            del keep
            sent = 1
        # a source with tensors past the manifest fails only after its last chunk: settle that before finishing
        self._step("checking the end of its weights", [], None)
        self._call("finish_weight_update", self.client.finish_weight_update)
        return sent
