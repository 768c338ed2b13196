"""The `planning` benchmark scenario (kv-mooncake's descriptor and block-run planning) and its discovery
through the `ascend_dist.scenarios` entry points."""

from importlib.metadata import EntryPoint

import pytest

from ascend_dist.common.blocks import contiguous_runs
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.scenarios import ENTRY_POINT_GROUP, ScenarioContext, discover_scenarios
from ascend_dist.kv_mooncake._demo.bench_planning import (
    descriptors_baseline,
    fragmented_ids,
    make_scenario,
    runs_baseline,
)


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


class _Progress:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def step(self, message: str) -> None:
        self.steps.append(message)

    def advance(self, done: int, total: int) -> None:
        pass


def test_installed_planning_scenario_is_discovered():
    found, broken = discover_scenarios()
    assert "planning" in found
    assert not broken


def test_a_broken_entry_point_is_reported_and_does_not_hide_the_others():
    found, broken = discover_scenarios(
        [
            _ep("planning", "ascend_dist.kv_mooncake._demo.bench_planning:make_scenario"),
            _ep("bad", "no_such_module:make"),
        ]
    )
    assert list(found) == ["planning"]
    assert "ModuleNotFoundError" in broken["bad"]


def test_two_scenarios_with_one_name_are_refused():
    ep = "ascend_dist.kv_mooncake._demo.bench_planning:make_scenario"
    with pytest.raises(ConfigError, match="scenario name"):
        discover_scenarios([_ep("a", ep), _ep("b", ep)])


def test_baselines_agree_with_the_vectorised_code_on_fragmented_ids():
    ids = fragmented_ids(5000, seed=4)
    assert len(set(ids.tolist())) == 5000
    starts, lengths = contiguous_runs(ids)
    assert (starts.tolist(), lengths.tolist()) == runs_baseline(ids.tolist())
    local, remote, sizes = descriptors_baseline([0], [1 << 20], [1, 2, 3, 7], [5, 6, 9, 10], 16)
    base = 1 << 20
    assert (local, remote, sizes) == ([16, 48, 112], [base + 80, base + 144, base + 160], [32, 16, 16])


def test_quick_planning_run_checks_pass_and_reports_two_ratios():
    progress = _Progress()
    report = make_scenario().run(ScenarioContext("bench", progress, quick=True, repeat=1))
    assert report.ok, report.checks
    assert len(report.measurements) == 2
    assert all(m.baseline > 0 and m.value > 0 for m in report.measurements)
    assert len(progress.steps) == 2
