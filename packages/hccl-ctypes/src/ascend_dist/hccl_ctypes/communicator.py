"""`PyHcclCommunicator`: collectives over HCCL (NCCL, or gloo on the CPU) outside torch.distributed.

Runs in: worker and trainer processes (imports torch).

Construction is collective over ``group`` (a CPU/gloo process group): every rank must build the
communicator at the same time. Steps: pick the engine (see below); rank 0 creates the root info;
it is broadcast over ``group`` as raw bytes; all ranks confirm arrival with a bounded all-reduce on
``group`` (so a peer that never joins fails construction within ``init_timeout_s`` instead of
hanging in the native init); every rank joins the native communicator; a warm-up all-reduce of one
float on the current stream is synchronized.

Engine choice (``backend``):

| backend | runtime | engine |
|---|---|---|
| ``"auto"`` | npu / cuda | the HCCL / NCCL library (``HCCL_SO_PATH`` / ``VLLM_NCCL_SO_PATH``) |
| ``"auto"`` | cpu | the library when ``library_path`` or the dialect's env var is set, else gloo on ``group`` |
| ``"library"`` | any | the library (on the CPU: an HCCL-ABI library over host pointers) |
| ``"gloo"`` | cpu | gloo on ``group`` |

Disabled mode: world size 1 (collectives are computed locally: all-reduce and all-gather copy,
broadcast is a no-op, send/recv refuse) or no usable library (every collective raises
`CommunicatorUnavailable`; ``disabled_reason`` says why). Never a silent wrong result.

Streams: each operation is enqueued on ``stream`` or the runtime's current stream. On hardware the
library enqueues it on that device stream; on the CPU simulation it runs on the stream's worker
thread, so it is ordered with copies on the same stream and its errors surface (sticky, typed) at the
stream's next ``synchronize()``. Results are ready after the stream is synchronized.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from ascend_dist.common.device import DeviceRuntime, Stream, get_runtime
from ascend_dist.common.errors import ConfigError, format_allowed
from ascend_dist.hccl_ctypes import _collectives
from ascend_dist.hccl_ctypes._bootstrap import (
    device_index_of,
    init_library,
    library_configured,
    normalise_device,
    ready_check,
)
from ascend_dist.hccl_ctypes._collectives import Collectives, CpuGroup, GlooCollectives
from ascend_dist.hccl_ctypes._lib import CollectiveLibrary
from ascend_dist.hccl_ctypes._validate import check_peer, check_same, check_tensor
from ascend_dist.hccl_ctypes.dialects import HCCL, NCCL, Dialect
from ascend_dist.hccl_ctypes.errors import CommunicatorClosed, CommunicatorUnavailable, LibraryLoadError
from ascend_dist.hccl_ctypes.torch_compat import op_code

__all__ = ["Backend", "PyHcclCommunicator"]

logger = logging.getLogger(__name__)

Backend = Literal["auto", "library", "gloo"]
_BACKENDS: tuple[str, ...] = ("auto", "library", "gloo")


def _local_copy(src: torch.Tensor, dst: torch.Tensor) -> Callable[[int], None]:
    """The world-size-1 result of all-reduce, all-gather and reduce-scatter: a copy (nothing when in place)."""

    def run(_handle: int) -> None:
        if dst.data_ptr() != src.data_ptr():
            dst.view(-1).copy_(src.view(-1))

    return run


class PyHcclCommunicator:
    """A communicator over a group of processes, usable outside torch.distributed's device backend.

    Attributes:
        rank: This process's rank in ``group``.
        world_size: Size of ``group``.
        available: True when an engine (library or gloo) is in use.
        disabled: True in disabled mode (world size 1 or no usable library).
        disabled_reason: Why it is disabled ("" when enabled).
        engine: ``"library"``, ``"gloo"`` or ``"none"``.
        device: The torch device the tensors must live on.
    """

    def __init__(
        self,
        group: CpuGroup,
        device: int | str | torch.device | None = None,
        library_path: str | None = None,
        *,
        backend: Backend = "auto",
        dialect: Dialect | None = None,
        runtime: DeviceRuntime | None = None,
        init_timeout_s: float = 60.0,
        op_timeout_s: float = 300.0,
    ) -> None:
        """Build the communicator (collective: every rank of ``group`` must call this concurrently).

        Args:
            group: A CPU (gloo) process group, registered with torch.distributed or not (a
                ``ProcessGroupGloo`` on a store), or vLLM's ``StatelessProcessGroup``; its ranks
                are the communicator's ranks.
            device: Device of the tensors: an index or ``"npu:0"``; None: the runtime's device. With
                no ``runtime``, the process's runtime of this device (None: the current device).
            library_path: The collective library; None: the dialect's env var, then its default name.
            backend: ``"auto"``, ``"library"`` or ``"gloo"`` (see the module docstring).
            dialect: `HCCL` or `NCCL`; None: NCCL on a cuda runtime, else HCCL.
            runtime: The device runtime; None: the process's runtime of ``device``. An explicit
                device index must be the runtime's (never enqueue on another device's stream).
            init_timeout_s: Deadline of the id exchange and of the arrival check.
            op_timeout_s: Deadline of each gloo operation (the library bounds its own waits).

        Raises:
            ConfigError: Not a process group, a GPU/NPU-backed group, an unknown backend, or a bad device.
            DeadlineExceeded: A peer did not join within ``init_timeout_s``.
            CollectiveError: The library refused to create the communicator.
        """
        if backend not in _BACKENDS:
            raise ConfigError("backend", backend, format_allowed(_BACKENDS))
        # ``group`` stays the caller's (as upstream: TRL calls ``comm.group.barrier()`` on its stateless
        # group). For vLLM's StatelessProcessGroup a gloo group of our own on its store carries the id
        # exchange and the gloo engine (its object collectives pickle).
        self.group: Any = group
        cpu_group = (
            _collectives.stateless_gloo_group(group, init_timeout_s)
            if _collectives.is_stateless_group(group)
            else group
        )
        self.rank, self.world_size = _collectives.group_rank_size(cpu_group)
        self._cpu_group: Any = cpu_group  # a ProcessGroup or a gloo Backend: only its own methods are called
        # The runtime of the tensors' device: its streams are where the operations are enqueued.
        self.runtime = runtime if runtime is not None else get_runtime(device)
        requested = device_index_of(device)
        if requested is not None and requested != self.runtime.device_index:
            raise ConfigError(
                "device", device, f"the runtime's device {self.runtime.name}:{self.runtime.device_index} (or None)"
            )
        self.dialect = dialect or (NCCL if self.runtime.name == "cuda" else HCCL)
        self.device = normalise_device(self.runtime, device)
        self.init_timeout_s = init_timeout_s
        self.available = False
        self.disabled = True
        self.disabled_reason = ""
        self.engine = "none"
        self.library: CollectiveLibrary | None = None
        self._collectives: Collectives | None = None
        self._streams: list[Stream] = []
        self._destroyed = False
        self._released = False  # the engine was closed: queued simulated ops refuse to run
        self._lock = threading.Lock()
        if self.world_size == 1:
            self.disabled_reason = "world size 1: collectives are computed locally"
            return
        if backend == "gloo" or (
            backend == "auto" and self.runtime.name == "cpu" and not library_configured(self.dialect, library_path)
        ):
            if self.runtime.name != "cpu":
                raise ConfigError(
                    "backend", backend, f"'library' on the {self.runtime.name} runtime (gloo is CPU-only)"
                )
            self._collectives = GlooCollectives(cpu_group, op_timeout_s)
            ready_check(cpu_group, self.world_size, init_timeout_s)
        else:
            try:
                self.library = CollectiveLibrary(self.dialect, library_path)
            except LibraryLoadError as exc:
                self.disabled_reason = str(exc)
                logger.warning("communicator disabled on rank %d: %s", self.rank, exc)
                return
            self._collectives = init_library(
                self.library, cpu_group, self.rank, self.world_size, device=self.device, timeout_s=init_timeout_s
            )
        self.engine = self._collectives.name
        self.available = True
        self.disabled = False
        try:
            self._warm_up()
        except BaseException:
            self.destroy(timeout_s=init_timeout_s)  # release the native communicator; re-raise the cause
            raise
        logger.info("communicator rank=%d world=%d engine=%s", self.rank, self.world_size, self.engine)

    # -- construction (the steps before the warm-up live in _bootstrap) ---------------------------

    def _warm_up(self) -> None:
        probe = torch.zeros(1, dtype=torch.float32, device=self.device)
        stream = self.runtime.current_stream()
        self.all_reduce(probe, stream=stream, out_tensor=probe)
        stream.synchronize(self.init_timeout_s)

    # -- plumbing ---------------------------------------------------------------------------------

    def _engine(self) -> Collectives | None:
        """The engine, None when world size is 1; raises when closed or unavailable."""
        if self._destroyed:
            raise CommunicatorClosed("the communicator was destroyed")
        if self._collectives is None and self.world_size > 1:
            raise CommunicatorUnavailable(f"the communicator is disabled: {self.disabled_reason}")
        return self._collectives

    def _check(self, field: str, tensor: torch.Tensor) -> None:
        check_tensor(field, tensor, self.dialect, self.device)

    def _launch(self, stream: Stream | None, fn: Callable[[int], None], *, collective: bool = True) -> None:
        target = stream if stream is not None else self.runtime.current_stream()
        if target not in self._streams:
            self._streams.append(target)
        handle = getattr(target, "handle", None)
        if handle is not None:  # a device stream: the library enqueues the op on it
            with self._lock:
                fn(int(handle))
            return

        def run() -> None:  # the CPU simulation: run in order on the stream's worker thread
            with self._lock:  # never two ops of one communicator at once in this process
                if self._released:  # destroy gave up waiting for this op: never touch a released engine
                    raise CommunicatorClosed("the communicator was destroyed while this operation was queued")
                fn(0)

        if collective and target.query():
            # Nothing is queued on the stream, so running a collective here is indistinguishable from its
            # thread running it next, minus two thread hand-offs (~0.1 ms a call). Not for send/recv: a
            # blocking send here could deadlock a symmetric exchange. Errors still surface at synchronize.
            try:
                run()
            except Exception as exc:
                self.runtime.launch_host_func(target, _reraise(exc))
            return
        self.runtime.launch_host_func(target, run)

    # -- collectives ------------------------------------------------------------------------------

    def all_reduce(
        self,
        in_tensor: torch.Tensor,
        op: object = dist.ReduceOp.SUM,
        stream: Stream | None = None,
        *,
        out_tensor: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All-reduce ``in_tensor`` into ``out_tensor`` (a new tensor when None; ``in_tensor`` for in place).

        The positional order is upstream vllm-ascend ``pyhccl``'s ``all_reduce(in_tensor, op, stream)``;
        a tensor in ``op``'s place (vLLM's ``PyNcclCommunicator`` order) raises `UnsupportedOp`.

        Args:
            in_tensor: Contiguous tensor on the communicator's device.
            op: A ``torch.distributed.ReduceOp`` (SUM, PRODUCT, MAX, MIN).
            stream: Stream to enqueue on; None: the runtime's current stream.
            out_tensor: Same dtype and size (keyword only); None allocates one.

        Returns:
            ``out_tensor``, valid once ``stream`` is synchronized.

        Raises:
            ConfigError: Bad tensor (dtype, device, contiguity, size); `UnsupportedOp` for ``op``.
            CommunicatorUnavailable: Disabled for lack of a library.
            CommunicatorClosed: After `destroy`.
        """
        engine = self._engine()
        self._check("in_tensor", in_tensor)
        out = torch.empty_like(in_tensor) if out_tensor is None else out_tensor
        self._check("out_tensor", out)
        check_same("out_tensor", out, in_tensor.dtype, in_tensor.numel())
        op_code(self.dialect, op)
        if engine is None:
            self._launch(stream, _local_copy(in_tensor, out))
        else:
            self._launch(stream, lambda h: engine.all_reduce(in_tensor, out, op, h))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, stream: Stream | None = None) -> None:
        """Broadcast ``tensor`` in place from group rank ``src`` (a no-op at world size 1)."""
        engine = self._engine()
        self._check("tensor", tensor)
        check_peer("src", src, self.world_size)
        if engine is not None:
            self._launch(stream, lambda h: engine.broadcast(tensor, src, h))

    def send(self, tensor: torch.Tensor, dst: int, stream: Stream | None = None) -> None:
        """Send ``tensor`` to group rank ``dst`` (pairs with its `recv` of the same size and dtype)."""
        engine = self._p2p_engine()
        self._check("tensor", tensor)
        check_peer("dst", dst, self.world_size, not_rank=self.rank)
        self._launch(stream, lambda h: engine.send(tensor, dst, h), collective=False)

    def recv(self, tensor: torch.Tensor, src: int, stream: Stream | None = None) -> None:
        """Receive into ``tensor`` from group rank ``src``."""
        engine = self._p2p_engine()
        self._check("tensor", tensor)
        check_peer("src", src, self.world_size, not_rank=self.rank)
        self._launch(stream, lambda h: engine.recv(tensor, src, h), collective=False)

    def _p2p_engine(self) -> Collectives:
        engine = self._engine()
        if engine is None:
            raise ConfigError("world_size", self.world_size, "at least 2 for send/recv")
        return engine

    def all_gather(
        self, in_tensor: torch.Tensor, out_tensor: torch.Tensor | None = None, stream: Stream | None = None
    ) -> torch.Tensor:
        """Gather every rank's ``in_tensor`` into ``out_tensor`` (``world_size * numel`` elements, rank order).

        Returns:
            ``out_tensor`` (allocated as ``[world_size * in_tensor.shape[0], ...]`` when None).
        """
        engine = self._engine()
        self._check("in_tensor", in_tensor)
        if out_tensor is None:
            shape = (
                (self.world_size * in_tensor.shape[0], *in_tensor.shape[1:]) if in_tensor.dim() else (self.world_size,)
            )
            out_tensor = torch.empty(shape, dtype=in_tensor.dtype, device=in_tensor.device)
        out = out_tensor
        self._check("out_tensor", out)
        check_same("out_tensor", out, in_tensor.dtype, self.world_size * in_tensor.numel())
        if engine is None:
            self._launch(stream, _local_copy(in_tensor, out))
        else:
            self._launch(stream, lambda h: engine.all_gather(in_tensor, out, h))
        return out

    def reduce_scatter(
        self,
        in_tensor: torch.Tensor,
        out_tensor: torch.Tensor | None = None,
        op: object = dist.ReduceOp.SUM,
        stream: Stream | None = None,
    ) -> torch.Tensor:
        """Reduce ``in_tensor`` over the group; this rank receives slice ``rank`` of ``world_size`` equal slices.

        Returns:
            ``out_tensor`` (``in_tensor.numel() // world_size`` elements; allocated along dim 0 when None).
        """
        engine = self._engine()
        self._check("in_tensor", in_tensor)
        if in_tensor.numel() % self.world_size:
            raise ConfigError("in_tensor", f"{in_tensor.numel()} elements", f"a multiple of {self.world_size}")
        if out_tensor is None:
            shape = (in_tensor.shape[0] // self.world_size, *in_tensor.shape[1:]) if in_tensor.dim() else (1,)
            out_tensor = torch.empty(shape, dtype=in_tensor.dtype, device=in_tensor.device)
        out = out_tensor
        self._check("out_tensor", out)
        check_same("out_tensor", out, in_tensor.dtype, in_tensor.numel() // self.world_size)
        op_code(self.dialect, op)
        if engine is None:
            self._launch(stream, _local_copy(in_tensor, out))
        else:
            self._launch(stream, lambda h: engine.reduce_scatter(in_tensor, out, op, h))
        return out

    # -- teardown ---------------------------------------------------------------------------------

    def destroy(self, timeout_s: float = 60.0) -> None:
        """Wait for the streams this communicator used, then release the native communicator.

        Idempotent: a second call does nothing. Not collective, but do not destroy while a peer may
        still be inside a collective with this rank.

        Raises:
            DeadlineExceeded: A stream did not drain within ``timeout_s``. An operation still queued
                on a simulated stream then fails with `CommunicatorClosed` instead of running; on a
                device stream the native communicator is leaked (never freed under a queued op).
        """
        if self._destroyed:
            return
        self._destroyed = True
        streams, self._streams = list(self._streams), []
        try:
            for stream in streams:
                stream.synchronize(timeout_s)
        except BaseException:
            # An operation may still be queued. Simulated streams run it under the lock and see
            # `_released`, so the engine can go; a device stream already holds the native
            # communicator in its queue, so freeing it would be a use after free: leak it instead.
            if any(getattr(stream, "handle", None) is not None for stream in streams):
                self._collectives = None
                logger.error(
                    "communicator rank %d: streams did not drain; the native communicator is leaked", self.rank
                )
                raise
            self._release()
            raise
        self._release()

    def _release(self) -> None:
        with self._lock:  # after any op running now; queued ones then refuse (see `_launch`)
            self._released = True
            engine, self._collectives = self._collectives, None
        if engine is not None:
            engine.close()

    def close(self) -> None:
        """Upstream's name for `destroy` (same behaviour: idempotent, waits for the streams first)."""
        self.destroy()

    def __enter__(self) -> PyHcclCommunicator:
        """Use as a context manager that calls `destroy` on exit."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Destroy the communicator."""
        self.destroy()


def _reraise(exc: Exception) -> Callable[[], None]:
    def raise_on_stream() -> None:
        raise exc

    return raise_on_stream
