"""The `eplb` demo/bench scenario runs end to end (forked gloo ranks) and reports what it checked."""

from ascend_dist.common.scenarios import Scenario, ScenarioContext
from ascend_dist.eplb_ascend._demo.scenario import make_scenario


class Progress:
    def __init__(self):
        self.steps = []

    def step(self, message):
        self.steps.append(message)

    def advance(self, done, total):
        pass


def test_demo_passes_every_check():
    scenario = make_scenario()
    assert isinstance(scenario, Scenario) and scenario.modes == {"demo", "bench"}
    progress = Progress()
    report = scenario.run(ScenarioContext(mode="demo", progress=progress))
    assert report.ok, [c for c in report.checks if not c.ok]
    assert len(report.checks) == 9 and "4 ranks" in progress.steps[0]


def test_quick_bench_reports_minimum_bytes():
    report = make_scenario().run(ScenarioContext(mode="bench", progress=Progress(), quick=True, repeat=1))
    assert report.ok
    by_name = {m.name: m for m in report.measurements}
    assert by_name["bytes moved by the rearrangement"].ratio == 1.0
    assert by_name["expert transfer time (slowest rank)"].value > 0
