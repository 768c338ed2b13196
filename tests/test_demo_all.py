"""The README's main command: `ascend-dist demo` runs every installed scenario, each one verified.

A fresh process, exactly as a newcomer runs it (the scenarios start their own P/D, rank and server
processes on loopback). The JSON report must list every scenario the members register, each ok with
all its checks passing, so a scenario that silently stops being discovered fails here too.
"""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path

import pytest

from ascend_dist.cli.native_logs import is_native_log_line
from ascend_dist.common.scenarios import discover_scenarios

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(420)]


def test_demo_runs_every_installed_scenario_verified(tmp_path: Path) -> None:
    available, broken = discover_scenarios()
    assert not broken
    demo_scenarios = {name for name, s in available.items() if "demo" in s.modes}
    report = tmp_path / "demo.json"
    command = Path(sysconfig.get_path("scripts")) / "ascend-dist"  # the console script the README runs
    assert command.exists(), f"{command}: the meta-package's console script is not installed"
    done = subprocess.run(
        [str(command), "demo", "--json", str(report)], capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    native = [line for line in (done.stdout + done.stderr).splitlines() if is_native_log_line(line.encode())]
    assert not native, f"{len(native)} native log lines reached the terminal, e.g. {native[:3]}"
    reports = {r["scenario"]: r for r in json.loads(report.read_text())["reports"]}
    assert demo_scenarios <= set(reports), f"not run: {sorted(demo_scenarios - set(reports))}"
    assert {"pd", "pd-hybrid", "pd-layerwise", "pd-sfa", "pool", "offload", "weights", "hccl", "eplb"} <= set(reports)
    for name, r in reports.items():
        assert r["ok"] and r["error"] is None, (name, r["error"])
        assert r["checks"] and all(c["ok"] for c in r["checks"]), (name, [c for c in r["checks"] if not c["ok"]])


def test_verbose_lets_native_logs_through(tmp_path: Path) -> None:
    """The control of the check above: the same command with `-v` shows Mooncake's own lines, so the
    check can see them when they are there."""
    command = Path(sysconfig.get_path("scripts")) / "ascend-dist"
    done = subprocess.run(
        [str(command), "-v", "demo", "pool", "--quick"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert any(is_native_log_line(line.encode()) for line in done.stderr.splitlines()), done.stderr[-2000:]
