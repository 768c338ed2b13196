"""Demo/bench scenario ``weights``: a trainer (this process) and 2 worker processes over gloo.

Runs in: the ``ascend-dist demo``/``bench`` process, which starts the workers (from a fork server)
and always reaps them.

demo: a synthetic model of a few hundred tensors (mixed dtypes, scalars, unaligned sizes), three
consecutive packed-broadcast updates, bit-exact weights verified on both workers after each (by
SHA-256 of every parameter); then the same model through the IPC engine (shared memory), packed.

bench: 500 tensors of about 256 MiB in all, best of ``repeat`` runs of a full update (trainer send
until both workers have loaded it), each beside baselines on the same gloo group in the same run:
one broadcast per tensor (allocate, receive, load: upstream's unpacked path) and one flat broadcast
of the same bytes (the wire ceiling: no packing, no loading).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.weight_transfer.demo_procs import (
    Spec,
    WorkerProcess,
    llm_like_specs,
    param_digests,
    raw_send,
    synthetic_specs,
    synthetic_weights,
)
from ascend_dist.weight_transfer.ipc_trainer import IpcTrainer
from ascend_dist.weight_transfer.messages import DEFAULT_DIRECT_THRESHOLD_BYTES
from ascend_dist.weight_transfer.trainer import BroadcastTrainer

__all__ = ["WeightsScenario", "make_scenario"]

DTYPES = ("bfloat16", "float32", "float16", "float8_e4m3fn")
TIMEOUT_S = 120.0
BUFFER_BYTES = 32 * 1024 * 1024
DIRECT_BYTES = DEFAULT_DIRECT_THRESHOLD_BYTES


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


def _connect(workers: list[WorkerProcess], buffer_bytes: int, direct: int = DIRECT_BYTES) -> BroadcastTrainer:
    port = _free_port()
    for i, w in enumerate(workers):
        w.send(
            "init", master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=len(workers) + 1,
            dp_index=i, replica_size=1, rank_in_replica=0, packed=True, buffer_size_bytes=buffer_bytes,
            num_buffers=2, op_timeout_s=TIMEOUT_S, direct_threshold_bytes=direct,
        )  # fmt: skip
    trainer = BroadcastTrainer.connect("127.0.0.1", port, len(workers) + 1, buffer_size_bytes=buffer_bytes,
                                       op_timeout_s=TIMEOUT_S, direct_threshold_bytes=direct)  # fmt: skip
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
    return seconds, split


def _best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


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
        weights = synthetic_weights(specs, 1)
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        gib = nbytes / 1e9  # GB
        trainer = _connect(workers, BUFFER_BYTES)
        try:
            ctx.progress.step(f"packed broadcast of {len(specs)} tensors, {nbytes / (1 << 20):.0f} MiB")
            splits: list[dict[str, float]] = []

            def packed() -> float:
                seconds, split = _update(trainer, workers, specs, weights)
                splits.append(split)
                return seconds

            packed_s = _best(packed, ctx.repeat)
            want = param_digests(weights)
            report.check("packed update bit-exact on both workers",
                         all(w.call("digest", TIMEOUT_S)["digests"] == want for w in workers))  # fmt: skip
            split = min(splits, key=lambda s: sum(s.values()))
            report.check("time split (s)", True, ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
            ctx.progress.step("baseline: one broadcast per tensor")
            per_tensor_s = _best(lambda: raw_send(trainer, workers, "per_tensor", weights, TIMEOUT_S), ctx.repeat)
            ctx.progress.step("baseline: one flat broadcast of the same bytes")
            flat_s = _best(lambda: raw_send(trainer, workers, "flat", weights, TIMEOUT_S), ctx.repeat)
        finally:
            trainer.shutdown()
        report.measurements += [
            Measurement(f"packed broadcast, {len(specs)} tensors", packed_s, "s", per_tensor_s,
                        "one broadcast per tensor", higher_is_better=False, target_ratio=2.0),
            Measurement("packed broadcast throughput", gib / packed_s, "GB/s", gib / flat_s,
                        "one flat broadcast of the same bytes", target_ratio=0.85),
        ]  # fmt: skip


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
