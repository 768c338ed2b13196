"""Demo/bench scenario `eplb`: ranks over gloo, a synthetic MoE layer set, a skewed load, a rebalance.

Runs in: the `ascend-dist demo|bench` process, which forks the ranks (`launch.run_ranks`) and
joins them before returning. Demo: 4 ranks, 2 layers of 16 experts on 24 slots; every rank checks
the weights it holds, that its routing tables and maps were refreshed in place, and that the bytes
moved equal the minimum the placement change needs. Bench: 256 experts over 8 ranks (4 ranks and
64 experts with ``--quick``); bytes moved vs the minimum, and the rearrangement time vs raw gloo
``isend``/``irecv`` of the same experts between the same ranks, measured in the same run.
"""

from __future__ import annotations

from typing import Any

from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.eplb_ascend._demo.launch import run_ranks
from ascend_dist.eplb_ascend._demo.worker import run_rank

__all__ = ["EplbScenario", "make_scenario"]

DEMO = {"num_layers": 2, "num_logical": 16, "num_physical": 24, "shapes": [[32, 64], [64, 32]]}
BENCH = {"num_layers": 1, "num_logical": 256, "num_physical": 288, "shapes": [[128, 256], [256, 128]]}
QUICK_BENCH = {"num_layers": 1, "num_logical": 64, "num_physical": 80, "shapes": [[128, 256], [256, 128]]}
TIME_TARGET = 0.8


class EplbScenario:
    """The `eplb` demo and bench scenario."""

    name = "eplb"
    summary = "EPLB rebalance over gloo: skewed load, minimum-bytes expert moves, routing tables in place"
    modes = frozenset({"demo", "bench"})

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Run the ranks, then check what each reported."""
        report = ScenarioReport(self.name, ctx.mode)
        if ctx.mode == "demo":
            world, cfg = 4, {**DEMO, "mode": "rebalance"}
        else:
            world = 4 if ctx.quick else 8
            cfg = {**(QUICK_BENCH if ctx.quick else BENCH), "mode": "rebalance", "rounds": max(ctx.repeat, 1) * 2}
        ctx.progress.step(
            f"{world} ranks over gloo: {cfg['num_layers']} layer(s), {cfg['num_logical']} experts on "
            f"{cfg['num_physical']} slots, skewed load, rebalance"
        )
        seen = run_ranks(run_rank, cfg, world, timeout_s=300)
        self._checks(report, seen, world)
        if ctx.mode == "bench":
            self._measurements(report, seen)
        return report

    @staticmethod
    def _checks(report: ScenarioReport, seen: list[dict[str, Any]], world: int) -> None:
        every = lambda key: all(bool(s[key]) for s in seen)  # noqa: E731
        report.check("no load anywhere: every rank skips the rebalance", every("skip_when_quiet"))
        report.check("load on rank 0 only: every rank rebalances", every("fresh_anywhere"))
        report.check("placement changed; the hot expert got replicas", every("placement_changed"),
                     f"expert 0 replicas: {seen[0]['hot_replicas']}")  # fmt: skip
        report.check(f"expert weights verified on all {world} ranks", every("weights_ok"))
        report.check("routing tables refreshed in place (same tensor, same address)", every("table_in_place"))
        report.check("routing tables equal the committed maps", every("table_values_ok"))
        report.check("maps committed in place", every("maps_in_place"))
        report.check("vLLM-shaped add_send/add_recv/execute ring", every("queue_ok"))
        moved, minimum = seen[0]["bytes_moved"], seen[0]["bytes_minimum"]
        report.check("bytes moved equal the minimum the change requires", moved == minimum,
                     f"{moved:,} B moved, {minimum:,} B minimum")  # fmt: skip

    @staticmethod
    def _measurements(report: ScenarioReport, seen: list[dict[str, Any]]) -> None:
        moved, minimum = seen[0]["bytes_moved"], seen[0]["bytes_minimum"]
        report.measurements.append(
            Measurement("bytes moved by the rearrangement", moved / 2**20, "MiB", minimum / 2**20,
                        "minimum for the placement change", higher_is_better=False, target_ratio=1.0)
        )  # fmt: skip
        transfer = max(s["best"]["transfer"] for s in seen)
        whole = max(s["best"]["rearrange"] for s in seen)
        raw = max(s["best"]["raw"] for s in seen)
        report.measurements.append(
            Measurement("expert transfer time (slowest rank)", transfer * 1e3, "ms", raw * 1e3,
                        "raw gloo isend/irecv of the same experts", higher_is_better=False, target_ratio=TIME_TARGET)
        )  # fmt: skip
        report.measurements.append(
            Measurement("whole rearrangement (checks, transfers, vote, commit, tables)", whole * 1e3, "ms", raw * 1e3,
                        "raw gloo isend/irecv of the same experts", higher_is_better=False)
        )  # fmt: skip


def make_scenario() -> EplbScenario:
    """Entry point of `ascend_dist.scenarios`."""
    return EplbScenario()
