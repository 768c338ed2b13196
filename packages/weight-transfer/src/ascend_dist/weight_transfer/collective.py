"""The collective the broadcast engine needs, its gloo implementation, and the HCCL/NCCL seam.

Runs in: trainer and inference-worker processes.

The engine talks to a small `Collective` Protocol (async `broadcast`, blocking `all_reduce_sum`,
`barrier`, `destroy`). Membership is set up by `TransferGroup`: the trainer (rank 0) hosts a
`torch.distributed.TCPStore` on ``master_address:master_port`` (listening on that address only: the
trainer binds the socket itself and hands it to the store, which would otherwise listen on every
interface); every worker joins it; the data
plane is then built over the store by a `CollectiveFactory`:

- `gloo_collective`: a stateless `ProcessGroupGloo` over the store (the CPU path, used by tests);
- `hccl_collective` (Ascend/CUDA): `ascend_dist.hccl_ctypes.PyHcclCommunicator` on a stateless
  gloo bootstrap group, HCCL on Ascend and NCCL on CUDA (its gloo engine on the CPU runtime, which
  the tests run), wrapped in `CommunicatorCollective`.

Nothing touches the default torch.distributed group. The store also carries worker heartbeats
(`Heartbeat`), which let the trainer name a worker that died mid-update.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ascend_dist.common.errors import ConfigError, DeadlineExceeded

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = [
    "Collective",
    "CollectiveFactory",
    "CommunicatorCollective",
    "GlooCollective",
    "Heartbeat",
    "Pending",
    "TransferGroup",
    "gloo_collective",
    "hccl_collective",
    "lost_ranks",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class Pending(Protocol):
    """An issued collective; `wait` returns when its result is ready or raises if it failed."""

    def wait(self) -> None:
        """Block until done (bounded by the collective's op timeout)."""
        ...


@runtime_checkable
class Collective(Protocol):
    """What the broadcast engine needs from a communicator (all ranks call in the same order)."""

    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        """Start an in-place broadcast of ``tensor`` from rank ``src``."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across ranks; blocking."""
        ...

    def barrier(self) -> None:
        """Block until every rank has arrived."""
        ...

    def destroy(self) -> None:
        """Release the communicator; idempotent."""
        ...


@dataclass(frozen=True)
class TransferGroup:
    """The rendezvous of one trainer-to-workers transfer group.

    Attributes:
        store: The TCPStore (hosted by rank 0, the trainer).
        rank: This process's rank.
        world_size: Trainer plus all workers.
        op_timeout_s: Deadline of every collective operation.
        init_timeout_s: Deadline of the rendezvous.
    """

    store: Any  # torch.distributed.Store (typed loosely: torch's stubs lack its constructor)
    rank: int
    world_size: int
    op_timeout_s: float
    init_timeout_s: float = 60.0

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        *,
        timeout_s: float = 300.0,
        init_timeout_s: float | None = None,
    ) -> TransferGroup:
        """Host (rank 0) or join (other ranks) the group's TCPStore.

        Args:
            master_address: The trainer's address.
            master_port: The store's port.
            rank: This process's rank (0 hosts the store).
            world_size: Trainer plus all workers.
            timeout_s: Deadline of every collective operation.
            init_timeout_s: Deadline of the rendezvous (every rank joining); default
                ``max(timeout_s, 60)``: processes start at different speeds.

        Raises:
            ConfigError: Bad rank, world size or timeout.
        """
        if world_size < 2:
            raise ConfigError("world_size", world_size, "at least 2 (the trainer and one worker)")
        if not 0 <= rank < world_size:
            raise ConfigError("rank", rank, f"0..{world_size - 1}")
        if timeout_s <= 0:
            raise ConfigError("timeout_s", timeout_s, "a positive number of seconds")
        import torch.distributed as dist

        join_s = init_timeout_s if init_timeout_s is not None else max(timeout_s, 60.0)
        listen_fd = _listen_fd(master_address, master_port) if rank == 0 else None
        try:
            store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                master_address,
                master_port,
                world_size,
                rank == 0,
                timeout=datetime.timedelta(seconds=join_s),
                wait_for_workers=False,
                master_listen_fd=listen_fd,
            )
        except BaseException:
            if listen_fd is not None:
                socket.close(listen_fd)
            raise
        return cls(store, rank, world_size, timeout_s, join_s)


def _listen_fd(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only, for the TCPStore (which alone binds the wildcard).

    Raises:
        ConfigError: ``host`` is a wildcard, does not resolve, or ``host:port`` cannot be bound.
    """
    if host in ("", "0.0.0.0", "::", "[::]", "*"):
        raise ConfigError("master_address", host, "a specific interface such as '127.0.0.1', not a wildcard")
    try:
        family, _, _, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError("master_address", host, f"an address of this host ({exc})") from exc
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ConfigError("master_port", port, f"a free port on {host} ({exc})") from exc
    return sock.detach()


CollectiveFactory = Callable[[TransferGroup, "torch.device"], Collective]
"""Builds the data-plane communicator of a group (collective: every rank calls it together)."""


class _Work:
    """`Pending` over a torch.distributed Work."""

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def wait(self) -> None:
        self._work.wait()


class GlooCollective:
    """`Collective` over a stateless gloo process group built on the group's store (CPU tensors)."""

    def __init__(self, group: TransferGroup) -> None:
        """Create the gloo group (collective over every rank of ``group``)."""
        import torch
        import torch.distributed as dist

        prefix = dist.PrefixStore("wt/gloo", group.store)  # pyright: ignore[reportPrivateImportUsage]
        join = datetime.timedelta(seconds=group.init_timeout_s)  # connecting the mesh waits for every rank
        # typed Any: torch's stubs lack the Backend-level broadcast/allreduce overloads used below
        self._pg: Any = dist.ProcessGroupGloo(prefix, group.rank, group.world_size, join)
        self._timeout = datetime.timedelta(seconds=group.op_timeout_s)
        self.rank = group.rank
        self.world_size = group.world_size
        self.device = torch.device("cpu")

    def _group(self) -> Any:  # a ProcessGroupGloo
        if self._pg is None:
            raise ConfigError("collective", "destroyed", "a live collective (call init again)")
        return self._pg

    def broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        """Start an in-place broadcast from ``src``."""
        return _Work(self._group().broadcast(tensor, src, self._timeout))

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum in place across ranks."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.timeout = self._timeout
        self._group().allreduce([tensor], opts).wait()

    def barrier(self) -> None:
        """A one-element all-reduce: every rank must arrive."""
        import torch

        self.all_reduce_sum(torch.zeros(1, dtype=torch.int64))

    def destroy(self) -> None:
        """Drop the gloo group (its sockets close with it); idempotent."""
        self._pg = None


def gloo_collective(group: TransferGroup, device: torch.device) -> Collective:
    """`CollectiveFactory` of the CPU path."""
    if device.type != "cpu":
        raise ConfigError("device", str(device), "cpu (gloo moves CPU tensors; use hccl_collective on a device)")
    return GlooCollective(group)


class _Communicator(Protocol):
    """The subset of `ascend_dist.hccl_ctypes.PyHcclCommunicator` this package uses."""

    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Any = None) -> None: ...  # stream: a runtime Stream

    def all_reduce(self, in_tensor: torch.Tensor, op: Any = ..., *, out_tensor: torch.Tensor | None = None) -> Any: ...

    def destroy(self) -> None: ...


class _StreamDone:
    """`Pending` that waits for an event recorded after an enqueued device collective."""

    def __init__(self, event: Any, timeout_s: float) -> None:  # event: a runtime Event
        self._event = event
        self._timeout_s = timeout_s

    def wait(self) -> None:
        self._event.synchronize(timeout=self._timeout_s)


class CommunicatorCollective:
    """`Collective` over a stream-based communicator (`PyHcclCommunicator`: HCCL or NCCL)."""

    def __init__(self, comm: _Communicator, runtime: Any, op_timeout_s: float) -> None:  # runtime: DeviceRuntime
        """Wrap ``comm``; each broadcast runs on the runtime's current stream, then an event is recorded."""
        self._comm: _Communicator | None = comm
        self._runtime = runtime
        self._timeout_s = op_timeout_s
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.device = comm.device

    @property
    def communicator(self) -> _Communicator | None:
        """The wrapped communicator (None after `destroy`)."""
        return self._comm

    def _live(self) -> _Communicator:
        if self._comm is None:
            raise ConfigError("collective", "destroyed", "a live collective (call init again)")
        return self._comm

    def broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        """Enqueue the broadcast on the current stream and record an event after it."""
        stream = self._runtime.current_stream()
        self._live().broadcast(tensor, src, stream)
        return _StreamDone(stream.record_event(), self._timeout_s)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """All-reduce in place and wait for it."""
        self._live().all_reduce(tensor, out_tensor=tensor)
        self._runtime.current_stream().synchronize(self._timeout_s)

    def barrier(self) -> None:
        """A one-element all-reduce on the device."""
        import torch

        self.all_reduce_sum(torch.zeros(1, dtype=torch.int64, device=self.device))

    def destroy(self) -> None:
        """Destroy the native communicator (upstream never does: 14.3); idempotent."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()


def hccl_collective(group: TransferGroup, device: torch.device) -> Collective:
    """`CollectiveFactory` of the Ascend (HCCL) and CUDA (NCCL) path, built on `PyHcclCommunicator`.

    Builds a stateless gloo group over the store (never registered with torch.distributed) for the
    root-info exchange, then ``ascend_dist.hccl_ctypes.PyHcclCommunicator`` on it with the
    runtime of ``device``: the HCCL (NCCL) library on an NPU (GPU); on the CPU runtime the
    library when ``HCCL_SO_PATH`` is set, else the communicator's gloo engine (what the CPU tests run).

    Raises:
        ConfigError: ``device`` does not belong to this process's backend.
        DeadlineExceeded: A rank did not build its communicator within the group's ``init_timeout_s``.
    """
    import torch.distributed as dist

    from ascend_dist.common.device import get_runtime
    from ascend_dist.hccl_ctypes import PyHcclCommunicator

    prefix = dist.PrefixStore("wt/bootstrap", group.store)  # pyright: ignore[reportPrivateImportUsage]
    join = datetime.timedelta(seconds=group.init_timeout_s)  # connecting the mesh waits for every rank
    bootstrap = dist.ProcessGroupGloo(prefix, group.rank, group.world_size, join)
    runtime = get_runtime(device)  # its own device, not the thread's current one
    comm = PyHcclCommunicator(
        bootstrap, device=device, runtime=runtime, init_timeout_s=group.init_timeout_s, op_timeout_s=group.op_timeout_s
    )
    return CommunicatorCollective(comm, runtime, group.op_timeout_s)


class Heartbeat:
    """A worker's liveness counter in the store, bumped by one thread until `stop`."""

    def __init__(self, store: Any, rank: int, interval_s: float = 0.2) -> None:  # store: torch Store
        """Start the thread; ``interval_s`` between bumps."""
        self._store = store
        self._key = f"wt/hb/{rank}"
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._store.set(self._key, "0")
        self._thread = threading.Thread(target=self._run, name=f"wt-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(self._interval_s):
            count += 1
            try:
                self._store.set(self._key, str(count))
            except Exception as exc:  # the store host (trainer) is gone: nothing left to report to
                logger.warning("heartbeat %s stopped: %s", self._key, exc)
                return

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join the thread; idempotent."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise DeadlineExceeded(f"heartbeat thread {self._key} did not stop within {timeout_s} s")


def lost_ranks(store: Any, ranks: range, *, interval_s: float = 0.2, probes: int = 4) -> tuple[int, ...]:
    """Ranks whose heartbeat did not advance over ``probes`` heartbeat intervals.

    Args:
        store: The group's store.
        ranks: Worker ranks to check.
        interval_s: The workers' heartbeat interval.
        probes: How many intervals to observe (bounds the call to about ``probes * interval_s``).

    Returns:
        The ranks that look dead, ascending.
    """

    def read() -> dict[int, bytes | None]:
        out: dict[int, bytes | None] = {}
        for r in ranks:
            key = f"wt/hb/{r}"
            out[r] = store.get(key) if store.check([key]) else None
        return out

    before = read()
    time.sleep(interval_s * probes)
    after = read()
    return tuple(r for r in ranks if after[r] is None or after[r] == before[r])
