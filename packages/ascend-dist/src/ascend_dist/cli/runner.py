"""`ascend-dist demo` and `ascend-dist bench`: run the scenarios installed members contribute.

Scenarios are discovered through the `ascend_dist.scenarios` entry-point group
(`ascend_dist.common.scenarios`), so a new scenario never edits this module.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import TextIO

from ascend_dist.cli.render import format_number, render_table, write_json
from ascend_dist.common.scenarios import Mode, Scenario, ScenarioContext, ScenarioReport, discover_scenarios

__all__ = ["StreamProgress", "run_scenarios"]


class StreamProgress:
    """Prints phases and throttled progress with the elapsed time, to stderr by default."""

    def __init__(self, scenario: str, stream: TextIO | None = None, *, min_interval_s: float = 0.5) -> None:
        """Start the clock for `scenario`."""
        self._scenario = scenario
        self._stream = stream if stream is not None else sys.stderr
        self._start = time.monotonic()
        self._last = float("-inf")  # the first report always prints
        self._min_interval_s = min_interval_s

    def _emit(self, text: str) -> None:
        self._stream.write(f"[{time.monotonic() - self._start:6.1f}s] {self._scenario}: {text}\n")
        self._stream.flush()

    def step(self, message: str) -> None:
        """Announce a phase."""
        self._emit(message)

    def advance(self, done: int, total: int) -> None:
        """Report progress, at most every `min_interval_s`, and always the last unit."""
        now = time.monotonic()
        if done >= total or now - self._last >= self._min_interval_s:
            self._last = now
            self._emit(f"{done}/{total}")


def _select(mode: Mode, available: Mapping[str, Scenario], names: Sequence[str]) -> tuple[list[Scenario], list[str]]:
    eligible = {n: s for n, s in available.items() if mode in s.modes}
    unknown = [n for n in names if n not in eligible]
    chosen = [eligible[n] for n in names if n in eligible] if names else list(eligible.values())
    return chosen, unknown


def _run_one(scenario: Scenario, ctx: ScenarioContext) -> ScenarioReport:
    start = time.monotonic()
    try:
        report = scenario.run(ctx)
    except Exception as exc:  # a scenario failure is a result to report, not a crash of the command
        report = ScenarioReport(scenario.name, ctx.mode, error=f"{type(exc).__name__}: {exc}")
    report.seconds = time.monotonic() - start
    return report


def _summary_rows(reports: Sequence[ScenarioReport]) -> list[tuple[str, ...]]:
    rows = []
    for r in reports:
        passed = sum(c.ok for c in r.checks)
        status = "ok" if r.ok else "FAILED"
        detail = r.error or next((f"{c.name}: {c.detail}" for c in r.checks if not c.ok), "")
        rows.append((r.scenario, status, f"{passed}/{len(r.checks)}", f"{r.seconds:.1f}s", detail))
    return rows


def _measurement_rows(reports: Sequence[ScenarioReport]) -> list[tuple[str, ...]]:
    rows = []
    for r in reports:
        for m in r.measurements:
            target = (
                "" if m.target_ratio is None else f">= {m.target_ratio:g}x " + ("ok" if m.meets_target else "MISSED")
            )
            rows.append(
                (
                    r.scenario,
                    m.name,
                    f"{format_number(m.value)} {m.unit}",
                    f"{format_number(m.baseline)} {m.unit}",
                    m.baseline_name,
                    f"{format_number(m.ratio)}x",
                    target,
                )
            )
    return rows


def run_scenarios(
    mode: Mode,
    names: Sequence[str] = (),
    *,
    quick: bool = False,
    repeat: int = 3,
    json_path: str | None = None,
    discover: Callable[[], tuple[dict[str, Scenario], dict[str, str]]] = discover_scenarios,
    out: Callable[[str], None] = print,
    progress_stream: TextIO | None = None,
) -> int:
    """Run the chosen scenarios (all of this mode when `names` is empty); 0 when every check passed."""
    available, broken = discover()
    for name, reason in broken.items():
        out(f"warning: scenario {name} could not be loaded: {reason}")
    chosen, unknown = _select(mode, available, names)
    if unknown:
        known = ", ".join(sorted(n for n, s in available.items() if mode in s.modes)) or "none installed"
        out(f"unknown {mode} scenario(s): {', '.join(unknown)}; available: {known}")
        return 2
    if not chosen:
        out(f"no {mode} scenarios are installed: install members that contribute them, e.g. 'ascend-dist[all]'")
        return 0
    reports = []
    for scenario in chosen:
        ctx = ScenarioContext(mode, StreamProgress(scenario.name, progress_stream), quick=quick, repeat=repeat)
        reports.append(_run_one(scenario, ctx))
    out(render_table(("scenario", "result", "checks", "time", "detail"), _summary_rows(reports)))
    if mode == "bench" and any(r.measurements for r in reports):
        headers = ("scenario", "figure", "ours", "baseline", "baseline is", "ratio", "target")
        out("\n" + render_table(headers, _measurement_rows(reports)))
    if json_path:
        write_json(json_path, {"mode": mode, "reports": [_report_json(r) for r in reports]})
    return 0 if all(r.ok for r in reports) else 1


def _report_json(report: ScenarioReport) -> dict[str, object]:
    data = asdict(report)
    data["ok"] = report.ok
    for m_json, m in zip(data["measurements"], report.measurements, strict=True):
        m_json["ratio"] = m.ratio
        m_json["meets_target"] = m.meets_target
    return data
