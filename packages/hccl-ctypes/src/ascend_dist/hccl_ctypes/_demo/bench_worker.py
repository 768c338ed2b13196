"""One rank of the ``hccl`` benchmark: ``python -m ascend_dist.hccl_ctypes._demo.bench_worker RANK WORLD PORT ENGINE``.

Runs in: a child process started by `ascend_dist.hccl_ctypes._demo.bench`. Joins a gloo group on
127.0.0.1, builds a `PyHcclCommunicator` with ``ENGINE`` (``gloo`` or ``library``) on the CPU
runtime, and for each size times, in alternating rounds, the communicator and torch.distributed gloo
called directly on the same group (the baseline), calls interleaved one by one, each after a barrier;
the median of each side is reported. Each timed call includes the wait for completion (the stream's
synchronize for the communicator, the blocking call for gloo). Results are verified
(all-reduce sum and broadcast pattern equal bytes) before rank 0 prints one `BenchResult` as JSON.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from collections.abc import Callable

import msgspec
import torch
import torch.distributed as dist

from ascend_dist.common.device import create_runtime
from ascend_dist.hccl_ctypes.communicator import PyHcclCommunicator

__all__ = ["BENCH_VERSION", "BenchResult", "OpTiming"]

BENCH_VERSION = 1
SIZES = (4 << 10, 1 << 20, 64 << 20)
QUICK_SIZES = (4 << 10, 1 << 20)


class OpTiming(msgspec.Struct, frozen=True, kw_only=True):
    """Median seconds per call of one op at one size, through the communicator and through gloo."""

    op: str
    nbytes: int
    comm_s: float
    gloo_s: float
    verified: bool


class BenchResult(msgspec.Struct, frozen=True, kw_only=True):
    """What rank 0 reports to the parent (JSON on stdout, prefixed by ``BENCH ``)."""

    version: int
    engine: str
    timings: tuple[OpTiming, ...]


def _samples(nbytes: int, rounds: int) -> int:
    """Calls timed per side: many for small messages, a few for 64 MiB; scaled by ``rounds``.

    A 1 MiB call differs from gloo's by tens of microseconds, below this machine's jitter: 64 pairs
    a round keep the median steady there.
    """
    return rounds * max(4, min(200, (64 << 20) // nbytes))


def _timed(fn: Callable[[], None], group: dist.ProcessGroup) -> float:
    """Seconds of one call, started right after a barrier so both ranks enter together."""
    dist.barrier(group)
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _verify(comm: PyHcclCommunicator, rank: int, world: int, numel: int) -> tuple[bool, bool]:
    stream = comm.runtime.current_stream()
    x = torch.full((numel,), float(rank + 1))
    comm.all_reduce(x, out_tensor=x)
    pattern = torch.arange(numel, dtype=torch.float32).remainder_(251)
    b = pattern.clone() if rank == world - 1 else torch.zeros(numel)
    comm.broadcast(b, src=world - 1)
    stream.synchronize(60)
    return bool(torch.all(x == world * (world + 1) / 2)), bool(torch.equal(b, pattern))


def _ops(
    comm: PyHcclCommunicator, group: dist.ProcessGroup, t: torch.Tensor
) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """For each op: (through the communicator, waiting for its stream; gloo directly, blocking)."""
    stream = comm.runtime.current_stream()

    def comm_all_reduce() -> None:
        comm.all_reduce(t, out_tensor=t)
        stream.synchronize(60)

    def comm_broadcast() -> None:
        comm.broadcast(t, 0)
        stream.synchronize(60)

    def gloo_all_reduce() -> None:
        dist.all_reduce(t, group=group)

    def gloo_broadcast() -> None:
        dist.broadcast(t, 0, group=group)

    return {"all_reduce": (comm_all_reduce, gloo_all_reduce), "broadcast": (comm_broadcast, gloo_broadcast)}


def measure(comm: PyHcclCommunicator, group: dist.ProcessGroup, sizes: tuple[int, ...], rounds: int) -> list[OpTiming]:
    """Verify, then time each op at each size, calls interleaved; the median per-call seconds of each side."""
    timings: list[OpTiming] = []
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4, dtype=torch.float32)  # zeros stay zeros under repeated sums
        ok_reduce, ok_broadcast = _verify(comm, comm.rank, comm.world_size, t.numel())
        verified: dict[str, bool] = {"all_reduce": ok_reduce, "broadcast": ok_broadcast}
        samples = _samples(nbytes, rounds)
        for op, (through_comm, direct) in _ops(comm, group, t).items():
            comm_s: list[float] = []
            gloo_s: list[float] = []
            for i in range(samples):  # interleaved, so both sides see the same machine load
                if i % 2:  # and alternating which goes first, so neither always runs on a warmed-up path
                    comm_s.append(_timed(through_comm, group))
                    gloo_s.append(_timed(direct, group))
                else:
                    gloo_s.append(_timed(direct, group))
                    comm_s.append(_timed(through_comm, group))
            timings.append(
                OpTiming(
                    op=op, nbytes=nbytes, comm_s=statistics.median(comm_s), gloo_s=statistics.median(gloo_s),
                    verified=verified[op],
                )
            )  # fmt: skip
    return timings


def main() -> None:
    """Run one rank (see the module docstring)."""
    rank, world, port, engine = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    quick, rounds = sys.argv[5] == "quick", int(sys.argv[6])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    runtime = create_runtime("cpu")
    group = dist.group.WORLD
    assert isinstance(group, dist.ProcessGroup)
    try:
        with PyHcclCommunicator(group, backend="gloo" if engine == "gloo" else "library", runtime=runtime) as comm:
            timings = measure(comm, group, QUICK_SIZES if quick else SIZES, rounds)
            result = BenchResult(version=BENCH_VERSION, engine=comm.engine, timings=tuple(timings))
    finally:
        runtime.close()
        dist.destroy_process_group()
    if rank == 0:
        print("BENCH " + msgspec.json.encode(result).decode(), flush=True)


if __name__ == "__main__":
    main()
