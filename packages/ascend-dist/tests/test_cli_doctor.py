import json
import os
import subprocess
import sys
from pathlib import Path

from ascend_dist.cli.doctor import run_doctor
from ascend_dist.cli.probes import Finding


def _run(probes, tmp_path=None):
    lines: list[str] = []
    path = str(tmp_path / "doctor.json") if tmp_path else None
    rc = run_doctor(probe_list=probes, out=lines.append, json_path=path)
    return rc, "\n".join(lines), path


def test_all_ok_exits_zero_and_prints_every_part():
    probes = [lambda: Finding("torch", "ok", "2.14.0", required=True), lambda: [Finding("vllm", "warn", "absent")]]
    rc, text, _ = _run(probes)
    assert rc == 0
    assert "torch" in text and "vllm" in text and "ready" in text


def test_missing_required_part_exits_nonzero_and_names_it(tmp_path):
    probes = [
        lambda: Finding("libibverbs.so.1", "missing", "cannot be loaded", "apt-get install libibverbs1", True),
        lambda: Finding("vllm", "missing", "absent", required=False),
    ]
    rc, text, path = _run(probes, tmp_path)
    assert rc == 1
    assert "NOT READY: missing libibverbs.so.1" in text
    assert "apt-get install libibverbs1" in text
    report = json.loads(Path(path).read_text())
    assert report["ready"] is False
    assert [f["part"] for f in report["findings"]] == ["libibverbs.so.1", "vllm"]


def test_a_crashing_probe_becomes_a_blocking_finding():
    def probe_exploding():
        raise RuntimeError("boom")

    rc, text, _ = _run([probe_exploding])
    assert rc == 1
    assert "exploding" in text and "RuntimeError: boom" in text


def test_real_doctor_on_this_machine_reports_cpu_backend(tmp_path):
    env = {**os.environ, "ASCEND_DIST_DEVICE": "cpu"}
    out = tmp_path / "d.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_dist.cli.main", "doctor", "--json", str(out)],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    findings = {f["part"]: f for f in json.loads(out.read_text())["findings"]}
    assert findings["device backend"]["detail"].startswith("cpu")
    assert findings["ascend-dist-common"]["status"] == "ok"
    assert findings["torch"]["status"] in {"ok", "warn"}


def test_unknown_backend_name_makes_doctor_fail_with_the_allowed_values(tmp_path):
    env = {**os.environ, "ASCEND_DIST_DEVICE": "tpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "ascend_dist.cli.main", "doctor"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "ASCEND_DIST_DEVICE" in proc.stdout and "'cpu'" in proc.stdout
