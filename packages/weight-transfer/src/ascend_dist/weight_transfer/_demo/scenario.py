"""Demo/bench scenario ``weights``: a trainer (this process) and 2 worker processes over gloo.

Runs in: the ``ascend-dist demo``/``bench`` process, which starts the workers (from a fork server)
and always reaps them.

demo: a synthetic model of a few hundred tensors (mixed dtypes, scalars, unaligned sizes), three
consecutive packed-broadcast updates, bit-exact weights verified on both workers after each (by
SHA-256 of every parameter); then the same model through the IPC engine (shared memory), packed.

bench: an LLM-like model of 500 tensors (~267 MiB), a full update (trainer send until both workers
have loaded it) beside three baselines on the same gloo group (see `baselines`): one broadcast per
tensor (upstream's unpacked path), one flat buffer of the same bytes end to end (pack, one
broadcast, load), and the wire ceiling (one prefilled buffer, no pack, no load). One untimed
warm-up of each, then ``max(repeat, 5)`` rounds with the four runs interleaved, so drifting load
from other jobs hits all of them alike; every figure is a median. The bench process runs torch on
one thread, like each worker.

bench, streamed: the same model as a streamed update (`broadcast`: whole-tensor buckets of
``STREAM_BUFFER_BYTES``, ``STREAM_NUM_BUFFERS`` per side, each loaded as it lands), interleaved with
a raw broadcast of the same bytes on the same group (the wire ceiling). ``staging_peak_ratio`` is
the largest peak of extra simulated-device bytes of any process (trainer or worker) during one
streamed update, measured by `CpuSimRuntime`'s allocation counters, over the configured bound
``STREAM_BUFFER_BYTES * STREAM_NUM_BUFFERS``; it must be at most 1.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.weight_transfer._demo.baselines import MODES, raw_send
from ascend_dist.weight_transfer._demo.procs import (
    Spec,
    WorkerProcess,
    device_meter,
    llm_like_specs,
    param_digests,
    synthetic_specs,
    synthetic_weights,
)
from ascend_dist.weight_transfer.ipc_trainer import IpcTrainer
from ascend_dist.weight_transfer.messages import DEFAULT_DIRECT_THRESHOLD_BYTES
from ascend_dist.weight_transfer.trainer import BroadcastTrainer

__all__ = ["WeightsScenario", "make_scenario"]

DTYPES = ("bfloat16", "float32", "float16", "float8_e4m3fn")
TIMEOUT_S = 120.0
DIRECT_BYTES = DEFAULT_DIRECT_THRESHOLD_BYTES
# Bench geometry, from sweeps of 2-64 MiB buffers x depth 2-4 x direct threshold 256 KiB-off: many
# collectives (buffers <= 4 MiB, thresholds <= 1 MiB) were 15-35 % slower; 8-32 MiB at depth 2-3
# were within the run-to-run noise of each other.
BUFFER_BYTES = 16 * 1024 * 1024
BENCH_DIRECT_BYTES = DEFAULT_DIRECT_THRESHOLD_BYTES  # 16 MiB: only a tensor that fills a buffer goes direct
BENCH_NUM_BUFFERS = 3
BENCH_MIN_ROUNDS = 5
# Streamed: the bench model (267 MiB, largest tensor 8 MiB) is ~17 buffers and ~8 bounds.
STREAM_BUFFER_BYTES = 16 * 1024 * 1024
STREAM_NUM_BUFFERS = 2


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _all_ok(workers: list[WorkerProcess]) -> list[dict[str, Any]]:
    replies = [w.reply(TIMEOUT_S) for w in workers]
    for reply in replies:
        if not reply["ok"]:
            raise RuntimeError(f"worker failed: {reply['error']}: {reply['message']}")
    return replies


def _connect(
    workers: list[WorkerProcess], buffer_bytes: int, direct: int = DIRECT_BYTES, depth: int = 2,
    streamed: bool = False,
) -> BroadcastTrainer:  # fmt: skip
    port = _free_port()
    for i, w in enumerate(workers):
        w.send(
            "init", master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=len(workers) + 1,
            dp_index=i, replica_size=1, rank_in_replica=0, packed=True, buffer_size_bytes=buffer_bytes,
            num_buffers=depth, op_timeout_s=TIMEOUT_S, direct_threshold_bytes=direct, streamed=streamed,
        )  # fmt: skip
    trainer = BroadcastTrainer.connect("127.0.0.1", port, len(workers) + 1, buffer_size_bytes=buffer_bytes,
                                       num_buffers=depth, op_timeout_s=TIMEOUT_S,
                                       direct_threshold_bytes=direct, streamed=streamed)  # fmt: skip
    _all_ok(workers)
    return trainer


def _update(trainer: BroadcastTrainer, workers: list[WorkerProcess], specs: list[Spec],
            weights: list[Any]) -> tuple[float, dict[str, float]]:  # fmt: skip
    """One packed update; returns its wall time and the phase split (trainer + slowest worker)."""
    for w in workers:
        w.send("start")
    _all_ok(workers)
    t0 = time.perf_counter()
    for w in workers:
        w.send("update", names=[s[0] for s in specs], dtype_names=[s[1] for s in specs],
               shapes=[list(s[2]) for s in specs])  # fmt: skip
    phases = trainer.send(weights)
    replies = _all_ok(workers)
    seconds = time.perf_counter() - t0
    for w in workers:
        w.send("finish")
    _all_ok(workers)
    split = {
        "pack": phases.pack_s, "trainer wire wait": phases.transfer_s,
        "unpack": max(r["unpack_s"] for r in replies), "load": max(r["load_s"] for r in replies),
    }  # fmt: skip
    if not trainer.streamed:  # the host restore point, copied while the bytes are on the wire (inside the wire wait)
        split["worker restore point"] = max(r.get("extra", {}).get("snapshot_s", 0.0) for r in replies)
    else:  # where each side waits (`broadcast` fills these for streamed updates)
        extra = [r.get("extra", {}) for r in replies]
        split |= {
            "trainer setup": phases.extra.get("setup_s", 0.0),
            "trainer final vote": phases.extra.get("final_vote_s", 0.0),
            "direct buckets": phases.extra.get("direct_buckets", 0.0),
            "worker setup": max(e.get("setup_s", 0.0) for e in extra),
            "worker first bucket": max(e.get("first_bucket_s", 0.0) for e in extra),
            "worker wire wait": max(r["transfer_s"] for r in replies),
            "worker final vote": max(e.get("final_vote_s", 0.0) for e in extra),
        }  # fmt: skip
    return seconds, split


class WeightsScenario:
    """The ``weights`` demo/bench scenario."""

    name = "weights"
    summary = "RL weight sync: packed broadcast trainer -> 2 workers (gloo), and same-chip IPC"
    modes = frozenset({"demo", "bench"})

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Start 2 workers, run the mode, always reap the workers."""
        report = ScenarioReport(self.name, ctx.mode)
        if ctx.mode == "bench":  # an LLM-like layout: most tensors tiny, most bytes in a few matrices
            specs = llm_like_specs(500, hidden=160 if ctx.quick else 512)
        else:  # awkward on purpose: scalars, fp8, odd sizes that straddle buffers
            specs = synthetic_specs(120 if ctx.quick else 300, (2 if ctx.quick else 24) << 20, dtypes=DTYPES)
        count = len(specs)
        ctx.progress.step(f"starting 2 worker processes with a {count}-tensor model")
        workers = [WorkerProcess(specs) for _ in range(2)]
        try:
            if ctx.mode == "bench":
                self._bench(ctx, report, workers, specs)
            else:
                self._demo(ctx, report, workers, specs)
        finally:
            for w in workers:
                w.close()
        return report

    def _demo(self, ctx: ScenarioContext, report: ScenarioReport, workers: list[WorkerProcess],
              specs: list[Spec]) -> None:  # fmt: skip
        trainer = _connect(workers, 1 << 20)
        try:
            for update in (1, 2, 3):
                ctx.progress.step(f"broadcast update {update} of 3 (packed, 1 MiB buffers)")
                weights = synthetic_weights(specs, update)
                seconds, _ = _update(trainer, workers, specs, weights)
                want = param_digests(weights)
                for i, w in enumerate(workers):
                    same = w.call("digest", TIMEOUT_S)["digests"] == want
                    report.check(
                        f"update {update}: worker {i} bit-exact", same, f"{len(specs)} tensors, {seconds:.2f} s"
                    )
        finally:
            trainer.shutdown()
        ctx.progress.step("IPC update (shared memory, packed, 1 MiB buffer)")
        runtime = CpuSimRuntime()
        try:
            for w in workers:
                w.call("ipc", TIMEOUT_S, action="init", init_info={"packed": True, "buffer_size_bytes": 1 << 20},
                       uuid="demo-cpu0")  # fmt: skip
            weights = synthetic_weights(specs, 4)
            chunks = IpcTrainer(_ProcessClient(workers), runtime, buffer_size_bytes=1 << 20, uuid="demo-cpu0").send(
                weights
            )
            want = param_digests(weights)
            for i, w in enumerate(workers):
                same = w.call("digest", TIMEOUT_S)["digests"] == want
                report.check(f"IPC update: worker {i} bit-exact", same, f"{chunks} chunks")
        finally:
            runtime.close()

    def _bench(self, ctx: ScenarioContext, report: ScenarioReport, workers: list[WorkerProcess],
               specs: list[Spec]) -> None:  # fmt: skip
        import torch

        weights = synthetic_weights(specs, 1)
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        rounds = max(ctx.repeat, BENCH_MIN_ROUNDS)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # like each worker: one CPU thread stands in for the trainer's device
        trainer = _connect(workers, BUFFER_BYTES, BENCH_DIRECT_BYTES, BENCH_NUM_BUFFERS)
        try:
            comm = trainer.collective
            assert comm is not None
            runs: dict[str, Callable[[], float]] = {
                mode: functools.partial(raw_send, comm, workers, mode, weights, TIMEOUT_S) for mode in MODES
            }
            splits: list[dict[str, float]] = []
            bare_splits: list[dict[str, float]] = []

            def packed(restore: bool, into: list[dict[str, float]]) -> float:
                for w in workers:  # the default takes the host restore point; off shows what it costs
                    w.send("restore_point", on=restore)
                _all_ok(workers)
                seconds, split = _update(trainer, workers, specs, weights)
                into.append(split)
                return seconds

            runs["packed"] = functools.partial(packed, True, splits)
            runs["packed_no_restore"] = functools.partial(packed, False, bare_splits)
            ctx.progress.step(f"{len(specs)} tensors, {nbytes / (1 << 20):.0f} MiB: warm-up, then {rounds} rounds "
                              f"of packed / packed without restore point / {' / '.join(MODES)}")  # fmt: skip
            times = _rounds(runs, rounds)
            splits, bare_splits = splits[1:], bare_splits[1:]  # drop the warm-up
            want = param_digests(weights)
            report.check("packed update bit-exact on both workers",
                         all(w.call("digest", TIMEOUT_S)["digests"] == want for w in workers))  # fmt: skip
            split = {k: statistics.median(s[k] for s in splits) for k in splits[0]}
            report.check("time split, median (s)", True, ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
            bare = {
                k: statistics.median(s[k] for s in bare_splits) for k in bare_splits[0] if k != "worker restore point"
            }
            report.check("time split, restore point off, median (s)", True,
                         ", ".join(f"{k} {v:.3f}" for k, v in bare.items()))  # fmt: skip
            _leave(workers)
            trainer.shutdown()
            self._bench_streamed(ctx, report, workers, specs, weights, rounds=rounds)
        finally:
            trainer.shutdown()
            torch.set_num_threads(threads)
        med = {mode: statistics.median(ts) for mode, ts in times.items()}
        gb = nbytes / 1e9
        # An all-or-nothing update costs about the wire time plus loading the staged bytes after the
        # commit, which limits its speed-up over one broadcast per tensor on this machine (an
        # estimate: one flat broadcast is not a strict ceiling, a pipelined stream can beat it).
        floor = med["flat_wire"] + split["load"]
        report.check("limit vs per tensor ~ per-tensor / (wire ceiling + load)", True,
                     f"{med['per_tensor']:.3f} / ({med['flat_wire']:.3f} + {split['load']:.3f}) = "
                     f"{med['per_tensor'] / floor:.2f}x")  # fmt: skip
        report.measurements += [
            Measurement(f"packed broadcast, {len(specs)} tensors (median)", med["packed"], "s", med["per_tensor"],
                        "one broadcast per tensor", higher_is_better=False, target_ratio=2.0),
            Measurement("packed broadcast throughput", gb / med["packed"], "GB/s", gb / med["flat"],
                        "one flat buffer: pack, 1 broadcast, load", target_ratio=0.85),
            Measurement("packed broadcast throughput", gb / med["packed"], "GB/s", gb / med["flat_wire"],
                        "wire ceiling: no pack, no load"),
            Measurement("packed, restore point off: vs one broadcast per tensor", med["packed_no_restore"], "s",
                        med["per_tensor"], "one broadcast per tensor", higher_is_better=False),
            Measurement("packed, restore point off: throughput", gb / med["packed_no_restore"], "GB/s",
                        gb / med["flat"], "one flat buffer: pack, 1 broadcast, load"),
        ]  # fmt: skip

    def _bench_streamed(self, ctx: ScenarioContext, report: ScenarioReport, workers: list[WorkerProcess],
                        specs: list[Spec], weights: list[Any], *, rounds: int) -> None:  # fmt: skip
        """Streamed updates vs a raw broadcast of the same bytes, and the measured staging peak."""
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        bound = STREAM_BUFFER_BYTES * STREAM_NUM_BUFFERS
        trainer = _connect(workers, STREAM_BUFFER_BYTES, 0, STREAM_NUM_BUFFERS, streamed=True)
        try:
            comm = trainer.collective
            assert comm is not None
            bases = _memory_bases(workers)  # before the first update: the buffers the engines keep count in full
            splits: list[dict[str, float]] = []

            def streamed() -> float:
                seconds, split = _update(trainer, workers, specs, weights)
                splits.append(split)
                return seconds

            raw_runs = [0]

            def raw() -> float:  # the first run fills the buffer, later ones find it filled (nothing else writes it)
                raw_runs[0] += 1
                return raw_send(comm, workers, "flat_wire", weights, TIMEOUT_S, refill=raw_runs[0] == 1)

            cpu: dict[str, list[list[float]]] = {"streamed": [], "raw": []}
            runs: dict[str, Callable[[], float]] = {
                "streamed": _cpu_metered(streamed, workers, cpu["streamed"]),
                "raw": _cpu_metered(raw, workers, cpu["raw"]),
            }
            ctx.progress.step(f"streamed: {nbytes / (1 << 20):.0f} MiB in {STREAM_BUFFER_BYTES >> 20} MiB buckets, "
                              f"{STREAM_NUM_BUFFERS} per side; {rounds} rounds of streamed / raw")  # fmt: skip
            times = _rounds(runs, rounds)
            peak = _peak_since(workers, bases)
            want = param_digests(weights)
            report.check("streamed update bit-exact on both workers",
                         all(w.call("digest", TIMEOUT_S)["digests"] == want for w in workers))  # fmt: skip
            split = {k: statistics.median(s[k] for s in splits[1:]) for k in splits[0]}
            report.check("streamed time split, median (s; the worker loads while receiving)", True,
                         ", ".join(f"{k} {v:.3f}" for k, v in split.items() if k != "unpack"))  # fmt: skip
            report.check("CPU seconds per run, median (trainer / worker 1 / worker 2; the 2 workers and the "
                         "trainer share this host's cores)", True, _cpu_line(cpu, times))  # fmt: skip
            _leave(workers)
        finally:
            trainer.shutdown()
        ratio = peak / bound
        report.check(
            "staging_peak_ratio <= 1.0", ratio <= 1.0,
            f"staging_peak_ratio {ratio:.3f}: peak {peak / (1 << 20):.1f} MiB of extra device memory over all "
            f"{rounds + 1} updates (largest of trainer and workers, counted from before the first: the buffers "
            f"kept between updates count) / bound {bound >> 20} MiB; model {nbytes / bound:.1f}x the bound, "
            f"{nbytes / STREAM_BUFFER_BYTES:.1f}x a buffer",
        )  # fmt: skip
        med = {name: statistics.median(ts) for name, ts in times.items()}
        report.measurements += [
            Measurement("streamed update (bounded staging), median", med["streamed"], "s", med["raw"],
                        "raw broadcast of the same bytes (one prefilled buffer, nothing loaded)",
                        higher_is_better=False, target_ratio=0.9),
            Measurement("staging peak (extra device bytes, any update)", peak / (1 << 20), "MiB", bound / (1 << 20),
                        "configured bound (buffer x num_buffers)", higher_is_better=False, target_ratio=1.0),
        ]  # fmt: skip


def _memory_bases(workers: list[WorkerProcess]) -> list[int]:
    """Simulated-device bytes allocated now (trainer, then each worker); starts a new peak everywhere."""
    import gc

    gc.collect()  # garbage of the staged section would otherwise leave the base during the measurement
    meter = device_meter()
    meter.reset_peak_allocated()
    return [meter.allocated_bytes] + [w.call("memory", TIMEOUT_S, reset_peak=True)["allocated"] for w in workers]


def _peak_since(workers: list[WorkerProcess], bases: list[int]) -> int:
    """The largest peak of extra simulated-device bytes of any process since `_memory_bases`."""
    peaks = [device_meter().peak_allocated_bytes - bases[0]]
    peaks += [w.call("memory", TIMEOUT_S)["peak"] - b for w, b in zip(workers, bases[1:], strict=True)]
    return max(peaks)


def _cpu_now(workers: list[WorkerProcess]) -> list[float]:
    """CPU seconds used so far by this process (every thread: gloo's too) and each worker (nan: unknown)."""
    import math
    import os

    times = os.times()
    ours = [times.user + times.system]
    return ours + [math.nan if (c := w.cpu_seconds()) is None else c for w in workers]


def _cpu_metered(
    run: Callable[[], float], workers: list[WorkerProcess], into: list[list[float]]
) -> Callable[[], float]:
    """``run``, appending the CPU seconds each process spent in it to ``into``."""

    def metered() -> float:
        before = _cpu_now(workers)
        seconds = run()
        into.append([b - a for a, b in zip(before, _cpu_now(workers), strict=True)])
        return seconds

    return metered


def _cpu_line(cpu: dict[str, list[list[float]]], times: dict[str, list[float]]) -> str:
    """Per run: median CPU seconds of each process, their sum, and the sum over 2 cores beside the wall."""
    parts = []
    for name, all_rows in cpu.items():
        rows = all_rows[1:]  # drop the warm-up
        per = [statistics.median(col) for col in zip(*rows, strict=True)]
        total = statistics.median(sum(r) for r in rows)
        parts.append(f"{name} {' / '.join(f'{c:.3f}' for c in per)} (sum {total:.3f}, /2 cores {total / 2:.3f}; "
                     f"wall {statistics.median(times[name]):.3f})")  # fmt: skip
    return "; ".join(parts)


def _leave(workers: list[WorkerProcess]) -> None:
    """Workers leave the group (heartbeats stopped) before the trainer closes its store."""
    for w in workers:
        w.send("leave")
    _all_ok(workers)


def _rounds(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """One untimed warm-up of every run, then ``rounds`` interleaved rounds (load drifts hit all alike)."""
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(fn())
    return times


class _ProcessClient:
    """A `WeightSyncClient` forwarding to worker processes (JSON over pipes)."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self._workers = workers

    def _all(self, action: str, **fields: Any) -> None:
        for w in self._workers:
            w.send("ipc", action=action, **fields)
        _all_ok(self._workers)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init", init_info=init_info, uuid=None)

    def start_weight_update(self) -> None:
        self._all("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("update", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish")


def make_scenario() -> WeightsScenario:
    """Entry point of ``ascend_dist.scenarios``."""
    return WeightsScenario()
