"""The engines behind `PyHcclCommunicator`: the native library (HCCL/NCCL ABI) or gloo.

Runs in: worker processes (imports torch).

Both take already-validated, contiguous tensors and a native stream handle (0 on the CPU, where
the call runs on the simulation's stream thread and completes before returning). A gloo call waits
at most ``op_timeout_s`` (torch's own wait with a timeout); the native library bounds its own waits
(``HCCL_EXEC_TIMEOUT``).
"""

from __future__ import annotations

import ctypes
import datetime
from typing import Protocol

import torch
import torch.distributed as dist

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.hccl_ctypes._lib import CollectiveLibrary
from ascend_dist.hccl_ctypes.errors import CollectiveError
from ascend_dist.hccl_ctypes.torch_compat import dtype_code, op_code

__all__ = ["Collectives", "GlooCollectives", "LibraryCollectives"]


class Collectives(Protocol):
    """What the communicator asks of an engine (group-local ranks everywhere)."""

    name: str

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor, op: object, stream: int) -> None:
        """Reduce ``inp`` over the group into ``out`` (may be ``inp``)."""
        ...

    def broadcast(self, tensor: torch.Tensor, src: int, stream: int) -> None:
        """Broadcast ``tensor`` in place from ``src``."""
        ...

    def send(self, tensor: torch.Tensor, dst: int, stream: int) -> None:
        """Send ``tensor`` to ``dst``."""
        ...

    def recv(self, tensor: torch.Tensor, src: int, stream: int) -> None:
        """Receive into ``tensor`` from ``src``."""
        ...

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, stream: int) -> None:
        """Gather every rank's ``inp`` into ``out`` in rank order."""
        ...

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: object, stream: int) -> None:
        """Reduce ``inp`` and scatter slice ``rank`` into ``out``."""
        ...

    def close(self) -> None:
        """Release the engine's resources (idempotent)."""
        ...


class LibraryCollectives:
    """Calls the native library through the binding, on device (or, on the CPU, host) pointers."""

    name = "library"

    def __init__(self, lib: CollectiveLibrary, comm: ctypes.c_void_p) -> None:
        """Drive ``comm``, a communicator created by ``lib``."""
        self.lib = lib
        self.comm: ctypes.c_void_p | None = comm

    def _comm(self) -> ctypes.c_void_p:
        if self.comm is None:
            raise CollectiveError(self.lib.dialect.name, -1, "communicator already destroyed")
        return self.comm

    def _dt(self, t: torch.Tensor) -> int:
        return dtype_code(self.lib.dialect, t.dtype)

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor, op: object, stream: int) -> None:
        """See `Collectives.all_reduce`."""
        code = op_code(self.lib.dialect, op)
        self.lib.all_reduce(inp.data_ptr(), out.data_ptr(), inp.numel(), self._dt(inp), code, self._comm(), stream)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: int) -> None:
        """See `Collectives.broadcast`."""
        self.lib.broadcast(tensor.data_ptr(), tensor.numel(), self._dt(tensor), src, self._comm(), stream)

    def send(self, tensor: torch.Tensor, dst: int, stream: int) -> None:
        """See `Collectives.send`."""
        self.lib.send(tensor.data_ptr(), tensor.numel(), self._dt(tensor), dst, self._comm(), stream)

    def recv(self, tensor: torch.Tensor, src: int, stream: int) -> None:
        """See `Collectives.recv`."""
        self.lib.recv(tensor.data_ptr(), tensor.numel(), self._dt(tensor), src, self._comm(), stream)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, stream: int) -> None:
        """See `Collectives.all_gather`."""
        self.lib.all_gather(inp.data_ptr(), out.data_ptr(), inp.numel(), self._dt(inp), self._comm(), stream)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: object, stream: int) -> None:
        """See `Collectives.reduce_scatter`."""
        code = op_code(self.lib.dialect, op)
        self.lib.reduce_scatter(inp.data_ptr(), out.data_ptr(), out.numel(), self._dt(inp), code, self._comm(), stream)

    def close(self) -> None:
        """Destroy the native communicator once."""
        comm, self.comm = self.comm, None
        if comm is not None:
            self.lib.comm_destroy(comm)


class GlooCollectives:
    """The CPU engine: torch.distributed over the (gloo) group itself, each wait bounded."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup, op_timeout_s: float) -> None:
        """Run collectives on ``group``; each waits at most ``op_timeout_s``."""
        self.group = group
        self.timeout = datetime.timedelta(seconds=op_timeout_s)
        self._global = dist.get_process_group_ranks(group)

    def _wait(self, work: dist.Work | None, what: str) -> None:
        if work is None:
            return
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                raise DeadlineExceeded(
                    f"gloo {what} did not complete within {self.timeout.total_seconds():g} s"
                ) from exc
            raise CollectiveError(f"gloo {what}", -1, str(exc)) from exc

    def all_reduce(self, inp: torch.Tensor, out: torch.Tensor, op: object, stream: int) -> None:
        """See `Collectives.all_reduce`."""
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        self._wait(dist.all_reduce(out, op=op, group=self.group, async_op=True), "all_reduce")  # type: ignore[arg-type]

    def broadcast(self, tensor: torch.Tensor, src: int, stream: int) -> None:
        """See `Collectives.broadcast`."""
        self._wait(dist.broadcast(tensor, self._global[src], group=self.group, async_op=True), "broadcast")

    def send(self, tensor: torch.Tensor, dst: int, stream: int) -> None:
        """See `Collectives.send`."""
        self._wait(dist.isend(tensor, self._global[dst], group=self.group), "send")

    def recv(self, tensor: torch.Tensor, src: int, stream: int) -> None:
        """See `Collectives.recv`."""
        self._wait(dist.irecv(tensor, self._global[src], group=self.group), "recv")

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, stream: int) -> None:
        """See `Collectives.all_gather`."""
        self._wait(dist.all_gather_single(out, inp, group=self.group, async_op=True), "all_gather")

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: object, stream: int) -> None:
        """See `Collectives.reduce_scatter` (gloo lacks reduce_scatter_tensor: all-reduce, then slice)."""
        full = inp.clone()
        self._wait(dist.all_reduce(full, op=op, group=self.group, async_op=True), "reduce_scatter")  # type: ignore[arg-type]
        rank = dist.get_rank(self.group)
        out.copy_(full.view(-1)[rank * out.numel() : (rank + 1) * out.numel()].view_as(out))

    def close(self) -> None:
        """Nothing to release: the group belongs to the caller."""
