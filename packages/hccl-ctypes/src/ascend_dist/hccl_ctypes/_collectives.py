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
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ascend_dist.common.errors import ConfigError, DeadlineExceeded
from ascend_dist.hccl_ctypes._lib import CollectiveLibrary
from ascend_dist.hccl_ctypes.errors import CollectiveError
from ascend_dist.hccl_ctypes.torch_compat import dtype_code, op_code

__all__ = [
    "Collectives",
    "CpuGroup",
    "GlooCollectives",
    "LibraryCollectives",
    "allreduce_options",
    "broadcast_options",
    "group_rank_size",
    "is_stateless_group",
    "stateless_gloo_group",
]


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


class CpuGroup(Protocol):
    """A CPU process group: a torch ``ProcessGroup`` (registered or not) or a ``ProcessGroupGloo``."""

    def rank(self) -> int:
        """This process's rank in the group."""
        ...

    def size(self) -> int:
        """Number of ranks in the group."""
        ...


def group_rank_size(group: object) -> tuple[int, int]:
    """This process's rank in ``group`` and its size, asked of the group itself.

    Works for a group registered with torch.distributed (the world, ``new_group``) and for one that
    is not (a ``ProcessGroupGloo`` built directly on a store), which ``dist.get_rank`` refuses.

    Raises:
        ConfigError: ``group`` is not a process group, or it is GPU/NPU-backed (hccl/nccl).
    """
    rank_fn, size_fn = getattr(group, "rank", None), getattr(group, "size", None)
    if not callable(rank_fn) or not callable(size_fn):
        wanted = "a torch.distributed ProcessGroup (e.g. gloo) or vLLM's StatelessProcessGroup"
        raise ConfigError("group", type(group).__name__, wanted)
    name_fn = getattr(group, "name", None)
    backend = str(name_fn()).lower() if callable(name_fn) else ""
    if backend in ("hccl", "nccl"):
        raise ConfigError("group", backend, "a CPU process group (gloo); the id travels on it")
    rank, size = int(rank_fn()), int(size_fn())  # pyright: ignore[reportArgumentType]
    if not 0 <= rank < size:
        raise ConfigError("group", f"rank {rank} of {size}", "a group this process is a member of")
    return rank, size


def is_stateless_group(group: object) -> bool:
    """Whether ``group`` has the shape of vLLM's ``StatelessProcessGroup``.

    That is a dataclass with ``rank`` and ``world_size`` ints and a c10d ``store`` (no ``rank()``
    method); it is told apart by shape so that this package never imports vLLM.
    """
    rank, size = getattr(group, "rank", None), getattr(group, "world_size", None)
    return (
        isinstance(rank, int)
        and isinstance(size, int)
        and not isinstance(rank, bool)
        and isinstance(getattr(group, "store", None), dist.Store)  # pyright: ignore[reportPrivateImportUsage]
    )


def stateless_gloo_group(group: Any, timeout_s: float) -> Any:
    """A gloo group over a ``StatelessProcessGroup``'s store, for the id exchange and the gloo engine.

    The stateless group's own object collectives pickle through the store; this package never
    unpickles a peer's bytes, so it builds a ``ProcessGroupGloo`` on a fresh prefix of the same
    store instead. The prefix comes from a per-rank counter kept in the store itself: ranks that
    build their communicators on one group in the same order (which construction being collective
    requires anyway) get the same prefix, also across processes that rebuilt the group object.

    Raises:
        ConfigError: ``rank`` outside ``[0, world_size)``.
        DeadlineExceeded: A peer did not join the gloo group within ``timeout_s``.
    """
    rank, size = int(group.rank), int(group.world_size)
    if not 0 <= rank < size:
        raise ConfigError("group", f"rank {rank} of {size}", "a group this process is a member of")
    seq = int(group.store.add(f"ascend_dist/pyhccl/seq/{rank}", 1))
    prefix = dist.PrefixStore(f"ascend_dist/pyhccl/{seq}", group.store)  # pyright: ignore[reportPrivateImportUsage]
    try:
        return dist.ProcessGroupGloo(prefix, rank, size, datetime.timedelta(seconds=timeout_s))  # pyright: ignore[reportPrivateImportUsage]
    except RuntimeError as exc:  # gloo's rendezvous through the store timed out or a peer vanished
        raise DeadlineExceeded(f"gloo group on the stateless group's store (communicator {seq}): {exc}") from exc


def _reduce_op(op: object) -> dist.ReduceOp:
    """``op`` (a ``ReduceOp`` or its name) as a ``ReduceOp`` (validated by `op_code` beforehand)."""
    if isinstance(op, dist.ReduceOp):
        return op
    name = op if isinstance(op, str) else getattr(op, "name", str(op).rsplit(".", 1)[-1])
    return dist.ReduceOp(getattr(dist.ReduceOp, str(name)))


def allreduce_options(op: object, timeout_s: float) -> dist.AllreduceOptions:
    """Options of a group-level all-reduce with ``op`` and a deadline."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = _reduce_op(op)
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return opts


def broadcast_options(root: int, timeout_s: float) -> dist.BroadcastOptions:
    """Options of a group-level broadcast from group rank ``root`` with a deadline."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    return opts


class GlooCollectives:
    """The CPU engine: the (gloo) group's own collectives, group-local ranks, each wait bounded.

    Only the group's methods are called (never ``torch.distributed.*(group=...)``), so a group that
    torch.distributed never registered works as well as the world or a ``new_group``.
    """

    name = "gloo"

    def __init__(self, group: CpuGroup, op_timeout_s: float) -> None:
        """Run collectives on ``group`` (a ProcessGroup or a gloo Backend); each waits at most ``op_timeout_s``."""
        self.group: Any = group  # its collectives are pybind overloads: typed loosely
        self.op_timeout_s = op_timeout_s
        self.timeout = datetime.timedelta(seconds=op_timeout_s)
        self.rank, _ = group_rank_size(group)
        # Options objects are copied by the C++ call, so one per root/op is reused: building them costs
        # a few microseconds per call, which is visible next to a 4 KiB collective.
        self._broadcast_opts: dict[int, dist.BroadcastOptions] = {}
        self._allreduce_opts: dict[object, dist.AllreduceOptions] = {}

    def _bcast_opts(self, root: int) -> dist.BroadcastOptions:
        opts = self._broadcast_opts.get(root)
        if opts is None:
            opts = self._broadcast_opts[root] = broadcast_options(root, self.op_timeout_s)
        return opts

    def _reduce_opts(self, op: object) -> dist.AllreduceOptions:
        key = op if isinstance(op, str) else str(op)
        opts = self._allreduce_opts.get(key)
        if opts is None:
            opts = self._allreduce_opts[key] = allreduce_options(op, self.op_timeout_s)
        return opts

    def _wait(self, work: dist.Work | None, what: str, *, bounded_by_options: bool = False) -> None:
        if work is None:
            return
        try:
            # A collective carries its deadline in its options (gloo aborts it); waiting with a timeout
            # as well costs ~10 us a call, which shows against small messages.
            work.wait() if bounded_by_options else work.wait(timeout=self.timeout)
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
        self._wait(self.group.allreduce([out], self._reduce_opts(op)), "all_reduce", bounded_by_options=True)

    def broadcast(self, tensor: torch.Tensor, src: int, stream: int) -> None:
        """See `Collectives.broadcast`."""
        self._wait(self.group.broadcast([tensor], self._bcast_opts(src)), "broadcast", bounded_by_options=True)

    def send(self, tensor: torch.Tensor, dst: int, stream: int) -> None:
        """See `Collectives.send`."""
        self._wait(self.group.send([tensor], dst, 0), "send")

    def recv(self, tensor: torch.Tensor, src: int, stream: int) -> None:
        """See `Collectives.recv`."""
        self._wait(self.group.recv([tensor], src, 0), "recv")

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, stream: int) -> None:
        """See `Collectives.all_gather`."""
        self._wait(self.group._allgather_base(out.view(-1), inp.view(-1)), "all_gather")

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: object, stream: int) -> None:
        """See `Collectives.reduce_scatter` (gloo lacks reduce_scatter_tensor: all-reduce, then slice)."""
        full = inp.clone()
        self._wait(self.group.allreduce([full], self._reduce_opts(op)), "reduce_scatter")
        rank = self.rank
        out.copy_(full.view(-1)[rank * out.numel() : (rank + 1) * out.numel()].view_as(out))

    def close(self) -> None:
        """Nothing to release: the group belongs to the caller."""
