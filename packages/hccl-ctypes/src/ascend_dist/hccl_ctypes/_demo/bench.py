"""Benchmark and demo scenario ``hccl``: the communicator vs torch.distributed gloo, 2 processes, CPU.

Runs in: the ``ascend-dist bench``/``demo`` process, which starts two rank processes
(`ascend_dist.hccl_ctypes._demo.bench_worker`) on 127.0.0.1 and kills them on any failure.

What is compared, honestly: on the CPU the communicator's engine is gloo on the same group
(on the CPU backend the collective library is gloo), so the ratio measures what the communicator
adds over calling gloo directly — argument checks, the enqueue on the simulated stream, the worker
thread hand-off and the stream synchronize — for all-reduce and broadcast of 4 KiB, 1 MiB and
64 MiB. Target: the communicator within 10 % of gloo at 1 MiB and above. When ``HCCL_SO_PATH``
names an HCCL-ABI library (e.g. the tests' shared-memory conformance library), a second set of
figures times the communicator over that library against the same gloo baseline; that is a different
engine, reported for information, not an overhead figure.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import msgspec

from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.hccl_ctypes._demo.bench_worker import BENCH_VERSION, BenchResult

__all__ = ["HcclBenchmark", "make_scenario"]

WORLD = 2
TIMEOUT_S = 300.0
TARGET_RATIO = 1 / 1.10  # gloo time / communicator time: at most 10 % slower
_DECODER = msgspec.json.Decoder(BenchResult)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def run_ranks(engine: str, *, quick: bool, rounds: int, timeout_s: float = TIMEOUT_S) -> BenchResult:
    """Start the rank processes, wait (bounded), decode rank 0's result; always reap the children.

    Raises:
        RuntimeError: A rank failed or printed no result.
        TimeoutError: The ranks did not finish within ``timeout_s``.
    """
    port = _free_port()
    env = {**os.environ, "ASCEND_DIST_DEVICE": "cpu"}
    args = [str(WORLD), str(port), engine, "quick" if quick else "full", str(rounds)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ascend_dist.hccl_ctypes._demo.bench_worker", str(rank), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for rank in range(WORLD)
    ]
    try:
        deadline = time.monotonic() + timeout_s
        outputs = [p.communicate(timeout=max(deadline - time.monotonic(), 1.0)) for p in procs]
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"hccl bench ranks did not finish within {timeout_s:g} s") from exc
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        if p.returncode != 0:
            raise RuntimeError(f"bench rank {rank} exited {p.returncode}: {err[-2000:]}")
    lines = [ln for ln in outputs[0][0].splitlines() if ln.startswith("BENCH ")]
    if not lines:
        raise RuntimeError("bench rank 0 printed no result")
    result = _DECODER.decode(lines[-1].removeprefix("BENCH "))
    if result.version != BENCH_VERSION:
        raise RuntimeError(f"bench worker version {result.version}, expected {BENCH_VERSION}")
    return result


class HcclBenchmark:
    """The ``hccl`` scenario."""

    name = "hccl"
    summary = "PyHcclCommunicator all-reduce/broadcast across 2 processes vs torch.distributed gloo"
    modes = frozenset({"bench", "demo"})

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Run the gloo-engine comparison (and the library engine when ``HCCL_SO_PATH`` is set)."""
        report = ScenarioReport(self.name, ctx.mode)
        quick = ctx.quick or ctx.mode == "demo"
        engines = ["gloo"] + (["library"] if os.environ.get("HCCL_SO_PATH") else [])
        for engine in engines:
            ctx.progress.step(f"2 ranks, communicator engine {engine}, vs gloo directly")
            result = run_ranks(engine, quick=quick, rounds=max(ctx.repeat, 1))
            report.check(f"engine is {engine}", result.engine == engine, result.engine)
            for t in result.timings:
                label = f"{t.op} {_size(t.nbytes)} ({engine})"
                if not report.check(f"{label}: results equal on both ranks", t.verified) or ctx.mode == "demo":
                    continue
                report.measurements.append(
                    Measurement(
                        f"{label} per call", t.comm_s * 1e3, "ms", t.gloo_s * 1e3, "torch.distributed gloo directly",
                        higher_is_better=False,
                        target_ratio=TARGET_RATIO if engine == "gloo" and t.nbytes >= 1 << 20 else None,
                    )
                )  # fmt: skip
        return report


def make_scenario() -> HcclBenchmark:
    """Entry point of ``ascend_dist.scenarios``."""
    return HcclBenchmark()
