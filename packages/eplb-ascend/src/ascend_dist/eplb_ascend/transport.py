"""Point-to-point transport for expert weights: a small Protocol, its gloo implementation, the device seam.

Runs in: the worker. `P2PTransport` is everything the weight mover and the EPLB communicator need:
batched sends/receives between group-local ranks with one deadline, and a small int64 all-gather
on the control path (shape fingerprints, commit votes). `GlooTransport` implements it over a
torch.distributed gloo group (CPU; tests, demo, CPU staging). `DeviceCollectiveTransport` is the
seam for the device collective: it drives any `PointToPointCommunicator` (the HCCL communicator of
ascend-dist-hccl-ctypes on Ascend, or vLLM's PyNccl on CUDA) for the bulk bytes and keeps the
control path on a CPU gloo transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, TransferError, TransferTimeout
from ascend_dist.common.timeouts import Deadline
from ascend_dist.eplb_ascend.p2p_schedule import rendezvous_order

__all__ = [
    "DeviceCollectiveTransport",
    "GlooTransport",
    "P2POperation",
    "P2PTransport",
    "PointToPointCommunicator",
    "RendezvousTransport",
    "SendRecvCommunicator",
]

_MIN_WAIT_S = 0.001


@dataclass(frozen=True)
class P2POperation:
    """One send or receive of a whole tensor with a group-local peer; `tag` pairs it with the peer's op."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    tag: int = 0


@runtime_checkable
class P2PTransport(Protocol):
    """Batched point-to-point transfers within one group (ranks are group-local)."""

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        ...

    def batch_send_recv(self, ops: Sequence[P2POperation], timeout_s: float) -> None:
        """Run every op; return when all completed. Raises TransferTimeout/TransferError."""
        ...

    def all_gather_int64(self, values: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Gather a 1-D int64 CPU tensor of the same length from every rank: ``[world, n]``."""
        ...


def _wait_all(works: list[Any], deadline: Deadline, what: str) -> None:
    for index, work in enumerate(works):
        left = deadline.remaining()
        try:
            if left <= 0:
                raise DeadlineExceeded(f"{what}: deadline passed before op {index} completed")
            work.wait(timeout=timedelta(seconds=max(left, _MIN_WAIT_S)))
        except DeadlineExceeded as exc:
            raise TransferTimeout(f"{what}: op {index} of {len(works)} missed the deadline") from exc
        except RuntimeError as exc:
            text = str(exc).lower()
            if deadline.remaining() <= 0 or "timed out" in text or "timeout" in text:
                raise TransferTimeout(f"{what}: op {index} of {len(works)} timed out ({exc})") from exc
            raise TransferError(f"{what}: op {index} of {len(works)} failed ({exc})") from exc


class GlooTransport:
    """`P2PTransport` over a torch.distributed gloo group (CPU tensors).

    Peers are group-local ranks; they are mapped to global ranks (what ``dist.isend`` wants) once,
    from the group's rank list. After a timeout gloo closes the pair: recreate the group before reuse.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        """Bind to `group` (default: the world group); torch.distributed must be initialized."""
        if not dist.is_initialized():
            raise ConfigError("torch.distributed", "not initialized", "an initialized default process group")
        self._group = group
        self._global_ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        self._rank = dist.get_rank(group)

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return len(self._global_ranks)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The underlying process group."""
        return self._group

    def global_rank(self, peer: int) -> int:
        """The global rank of group-local `peer`."""
        if not 0 <= peer < len(self._global_ranks) or peer == self._rank:
            allowed = f"a group rank in [0, {len(self._global_ranks)}) other than {self._rank}"
            raise ConfigError("peer", peer, allowed)
        return self._global_ranks[peer]

    def batch_send_recv(self, ops: Sequence[P2POperation], timeout_s: float) -> None:
        """Post every send/receive, then wait for all within one deadline."""
        deadline = Deadline.after(timeout_s)
        peers = [self.global_rank(op.peer) for op in ops]  # validate everything before posting anything
        for op in ops:
            if not op.tensor.is_contiguous() or op.tensor.device.type != "cpu":
                raise ConfigError(
                    "tensor", f"{tuple(op.tensor.shape)} on {op.tensor.device}", "a contiguous CPU tensor"
                )
        works: list[Any] = []
        for op, peer in zip(ops, peers, strict=True):
            fn = dist.isend if op.kind == "send" else dist.irecv
            work = fn(op.tensor, peer, group=self._group, tag=op.tag)
            if work is not None:
                works.append(work)
        _wait_all(works, deadline, "expert weight transfer")

    def all_gather_int64(self, values: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Gather one int64 vector per rank, within the deadline."""
        flat = values.reshape(-1).to(torch.int64).contiguous()
        out = [torch.empty_like(flat) for _ in range(self.world_size)]
        work = dist.all_gather(out, flat, group=self._group, async_op=True)
        assert work is not None
        _wait_all([work], Deadline.after(timeout_s), "control all-gather")
        return torch.stack(out)


class PointToPointCommunicator(Protocol):
    """What the device seam needs from a device communicator (HCCL on Ascend, NCCL on CUDA).

    The shape of vLLM's ``PyNcclCommunicator``: group-local ranks, ops enqueued on `stream`,
    grouped between `group_start`/`group_end` (``HcclBatchSendRecv`` or ``HcclSend``/``HcclRecv``
    inside a group on Ascend) so paired sends and receives cannot deadlock.
    """

    rank: int
    world_size: int

    def send(self, tensor: torch.Tensor, dst: int, stream: Any = None) -> None:
        """Enqueue a send of the whole tensor to group rank `dst`."""
        ...

    def recv(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """Enqueue a receive of the whole tensor from group rank `src`."""
        ...

    def group_start(self) -> None:
        """Open a group of point-to-point ops."""
        ...

    def group_end(self) -> None:
        """Close the group; the ops are issued."""
        ...


class SendRecvCommunicator(Protocol):
    """A device communicator with plain, ungrouped send/recv (``PyHcclCommunicator`` of hccl-ctypes)."""

    rank: int
    world_size: int

    def send(self, tensor: torch.Tensor, dst: int, stream: Any = None) -> None:
        """Enqueue a send of the whole tensor to group rank `dst`."""
        ...

    def recv(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None:
        """Enqueue a receive of the whole tensor from group rank `src`."""
        ...


class _DeviceTransport:
    """What both device transports share: rank checks, issuing one op, the deadline, CPU control."""

    def __init__(self, comm: SendRecvCommunicator, control: P2PTransport, synchronize: Any, stream: Any = None) -> None:
        """Wrap `comm`; `control` carries fingerprints and votes; `synchronize(timeout_s)` waits."""
        if comm.world_size != control.world_size or comm.rank != control.rank:
            raise ConfigError(
                "comm", f"rank {comm.rank}/{comm.world_size}", f"rank {control.rank}/{control.world_size} like control"
            )
        self._comm = comm
        self._control = control
        self._synchronize = synchronize
        self._stream = stream

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return self._comm.world_size

    @staticmethod
    def _check_standalone(ops: Sequence[P2POperation]) -> None:
        for op in ops:
            if op.tensor.storage_offset() != 0:
                raise ConfigError("tensor.storage_offset()", op.tensor.storage_offset(), "0 (a standalone tensor)")

    def _issue(self, op: P2POperation) -> None:
        if op.kind == "send":
            self._comm.send(op.tensor, op.peer, stream=self._stream)
        else:
            self._comm.recv(op.tensor, op.peer, stream=self._stream)

    def _wait(self, ops: Sequence[P2POperation], timeout_s: float) -> None:
        try:
            self._synchronize(timeout_s)
        except (TimeoutError, DeadlineExceeded) as exc:
            raise TransferTimeout(f"device p2p batch of {len(ops)} ops missed its deadline") from exc

    def all_gather_int64(self, values: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """Delegate to the CPU control transport."""
        return self._control.all_gather_int64(values, timeout_s)


class DeviceCollectiveTransport(_DeviceTransport):
    """`P2PTransport` whose bytes travel over a device communicator; control stays on CPU gloo.

    `synchronize(timeout_s)` must block until the stream's work completed or raise (on Ascend: an
    event recorded after the group, waited with a deadline through the device runtime).
    """

    _comm: PointToPointCommunicator

    def __init__(
        self, comm: PointToPointCommunicator, control: P2PTransport, synchronize: Any, stream: Any = None
    ) -> None:
        """Wrap a communicator with grouped send/recv."""
        super().__init__(comm, control, synchronize, stream)

    def batch_send_recv(self, ops: Sequence[P2POperation], timeout_s: float) -> None:
        """Issue all ops in one group (tags unused: per-pair FIFO order pairs them), then wait."""
        if not ops:
            return
        self._check_standalone(ops)
        self._comm.group_start()
        try:
            for op in ops:
                self._issue(op)
        finally:
            self._comm.group_end()
        self._wait(ops, timeout_s)


class RendezvousTransport(_DeviceTransport):
    """`P2PTransport` over ungrouped send/recv, issued in `rendezvous_order` so it cannot deadlock.

    Use it with a communicator that has no group/batch API; ops pair by per-peer FIFO order, so
    both sides must list them in the same order (the mover and vLLM both do). Control stays on
    `control` (CPU gloo); `synchronize(timeout_s)` waits for the stream.
    """

    def batch_send_recv(self, ops: Sequence[P2POperation], timeout_s: float) -> None:
        """Issue every op in the deadlock-free order, then wait for the stream within the deadline."""
        if not ops:
            return
        self._check_standalone(ops)
        for index in rendezvous_order([(op.kind, op.peer) for op in ops], self.rank, self.world_size):
            self._issue(ops[index])
        self._wait(ops, timeout_s)
