import io
import json

from ascend_dist.cli.main import main
from ascend_dist.cli.render import render_table
from ascend_dist.cli.runner import StreamProgress, run_scenarios
from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport


class FakeScenario:
    def __init__(self, name, modes=("demo", "bench"), ok=True, raises=None):
        self.name = name
        self.summary = f"fake {name}"
        self.modes = frozenset(modes)
        self.ok = ok
        self.raises = raises
        self.runs: list[ScenarioContext] = []

    def run(self, ctx):
        self.runs.append(ctx)
        if self.raises:
            raise self.raises
        ctx.progress.step("working")
        ctx.progress.advance(1, 1)
        report = ScenarioReport(self.name, ctx.mode)
        report.check("bytes equal", self.ok, "" if self.ok else "layer 2 differs")
        report.measurements.append(Measurement("copy", 2.0, "GB/s", 1.0, "raw engine", target_ratio=1.5))
        return report


def _discover(*scenarios, broken=None):
    return lambda: ({s.name: s for s in scenarios}, broken or {})


def _run(mode, *scenarios, names=(), **kw):
    lines: list[str] = []
    progress = io.StringIO()
    rc = run_scenarios(mode, names, discover=_discover(*scenarios), out=lines.append, progress_stream=progress, **kw)
    return rc, "\n".join(lines), progress.getvalue()


def test_runs_every_scenario_of_the_mode_and_prints_results():
    a, b, only_demo = FakeScenario("a"), FakeScenario("b"), FakeScenario("c", modes=("demo",))
    rc, text, progress = _run("bench", a, b, only_demo)
    assert rc == 0
    assert len(a.runs) == len(b.runs) == 1 and not only_demo.runs
    assert "raw engine" in text and "2x" in text and ">= 1.5x ok" in text
    assert "a: working" in progress and "1/1" in progress


def test_failed_check_or_exception_fails_the_run_with_the_reason(tmp_path):
    bad, boom = FakeScenario("bad", ok=False), FakeScenario("boom", raises=OSError("port busy"))
    path = tmp_path / "r.json"
    rc, text, _ = _run("demo", bad, boom, json_path=str(path))
    assert rc == 1
    assert "layer 2 differs" in text and "OSError: port busy" in text
    data = json.loads(path.read_text())
    assert [r["ok"] for r in data["reports"]] == [False, False]
    assert data["reports"][0]["measurements"][0]["ratio"] == 2.0


def test_unknown_name_lists_what_is_available():
    rc, text, _ = _run("demo", FakeScenario("pd"), names=("nope",))
    assert rc == 2
    assert "nope" in text and "available: pd" in text


def test_no_scenarios_installed_says_so():
    rc, text, _ = _run("demo")
    assert rc == 0
    assert "no demo scenarios are installed" in text


def test_progress_is_throttled_but_always_reports_the_end():
    stream = io.StringIO()
    progress = StreamProgress("x", stream, min_interval_s=3600)
    progress.advance(1, 10)
    progress.advance(2, 10)
    progress.advance(10, 10)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].endswith("10/10")


def test_render_table_aligns_columns():
    text = render_table(("a", "bb"), [("xxx", "y")])
    assert text.splitlines() == ["a    bb", "---  --", "xxx  y"]


def test_bench_rejects_zero_repeat(capsys):
    assert main(["bench", "--repeat", "0"]) == 2
    assert "--repeat must be at least 1" in capsys.readouterr().err
