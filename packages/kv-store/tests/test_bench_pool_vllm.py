"""Smoke test of the ``pool-vllm`` bench: both connectors through vLLM's Scheduler, verification proven live.

The bench's figures are only reported for rounds whose every loaded block equals the block A
computed; these tests run it on small shapes (``--quick``) and check that the verification ran for
both connectors, and that it fails, with no figure, when our instance B loads from a store that
never saw A's saves (a connector that moves nothing).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from ascend_dist.common.scenarios import ScenarioContext, ScenarioReport
from ascend_dist.kv_store._demo.bench_geometry import QUICK
from ascend_dist.kv_store._demo.bench_pool_vllm import OURS, OURS_VLLM_LAYOUT, PEER, PoolVllmScenario, make_scenario

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class _Progress:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def step(self, message: str) -> None:
        self.steps.append(message)

    def advance(self, done: int, total: int) -> None:
        pass


def _run(scenario: PoolVllmScenario) -> ScenarioReport:
    return scenario.run(ScenarioContext("bench", _Progress(), quick=True, repeat=1))


def _round_checks(report: ScenarioReport, label: str) -> list[tuple[bool, str]]:
    """The warm-up round's check and the timed round's, in order."""
    checks = [(c.ok, c.detail) for c in report.checks if c.name.startswith(label + " ")]
    assert len(checks) == 2, report.checks
    return checks


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_bench_fails_saying_what_to_install() -> None:
    report = _run(make_scenario())
    assert not report.ok and report.error is not None
    assert "needs vLLM" in report.error and "[vllm]" in report.error
    assert not report.measurements


@pytest.mark.vllm
@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_quick_bench_verifies_both_connectors_and_reports_ratios() -> None:
    report = _run(make_scenario())
    assert report.ok, (report.error, [c for c in report.checks if not c.ok])
    for label in (OURS, PEER, OURS_VLLM_LAYOUT):
        for ok, detail in _round_checks(report, label):
            want = f"{QUICK.requests} requests x {QUICK.chunks} chunks"
            assert ok and want in detail, detail  # the byte comparison ran over every chunk
    names = [m.name for m in report.measurements]
    assert [n.split(" ")[0] for n in names] == ["store", "load", "store", "load"]
    assert names[0].endswith(OURS) and names[2].endswith(OURS_VLLM_LAYOUT)
    for m in report.measurements:
        assert m.value > 0 and m.baseline > 0 and m.baseline_name.startswith(PEER)
        assert m.ratio == pytest.approx(m.value / m.baseline)
    assert [m.target_ratio for m in report.measurements] == [1.5, 1.5, None, None]


@pytest.mark.vllm
@pytest.mark.mooncake
@pytest.mark.timeout(600)
def test_bench_fails_without_figures_when_our_loads_find_nothing(fresh_master) -> None:
    """Control: our B reads an empty master (A's keys are missing there): every round fails, no rate."""
    scenario = PoolVllmScenario(ours_b_extra={"store_config": {"master_server_address": fresh_master.address}})
    report = _run(scenario)
    assert not report.ok and report.error is None
    for label in (OURS, OURS_VLLM_LAYOUT):
        for ok, detail in _round_checks(report, label):
            assert not ok and f"vLLM counted 0 loaded tokens, expected {QUICK.chunks * QUICK.block}" in detail, detail
    assert all(ok for ok, _ in _round_checks(report, PEER))  # the peer in the same run still verifies
    assert not report.measurements
