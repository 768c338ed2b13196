"""The `offload` demo/bench scenario runs and verifies its bytes (quick sizes)."""

from __future__ import annotations

from ascend_dist.common.scenarios import ScenarioContext
from ascend_dist.kv_offload._demo.scenario import make_scenario


class _Progress:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def step(self, message: str) -> None:
        self.steps.append(message)

    def advance(self, done: int, total: int) -> None:
        del done, total


def test_demo_checks_pass() -> None:
    progress = _Progress()
    report = make_scenario().run(ScenarioContext("demo", progress))
    assert report.ok, report.checks
    assert len(report.checks) == 4 and len(progress.steps) == 2


def test_quick_bench_reports_figures_with_baselines() -> None:
    report = make_scenario().run(ScenarioContext("bench", _Progress(), quick=True, repeat=1))
    assert report.ok, report.checks
    names = [m.name for m in report.measurements]
    assert any("D->H" in n for n in names) and any("descriptors" in n for n in names)
    assert all(m.baseline > 0 for m in report.measurements)
