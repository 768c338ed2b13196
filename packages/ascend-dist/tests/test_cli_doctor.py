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


def test_doctor_lists_every_listener_with_its_address_and_flags_mooncakes_wildcards():
    from ascend_dist.cli.ports import LISTENERS, probe_ports

    findings = probe_ports("10.0.0.5", 36000)
    assert len(findings) == len(LISTENERS)
    side = next(f for f in findings if "pull: P side channel" in f.part)
    assert side.status == "ok" and side.detail.startswith("10.0.0.5 port 36000")
    native = [f for f in findings if f.status == "warn"]
    assert [("0.0.0.0" in f.detail or "*" in f.detail) for f in native] == [True, True]  # Mooncake's two
    assert all("firewall" in f.fix for f in native)


def test_secret_command_writes_a_private_key_the_loader_accepts(tmp_path, monkeypatch, capsys):
    from ascend_dist.cli.main import main
    from ascend_dist.cli.ports import probe_authentication
    from ascend_dist.common.secret import SECRET_ENV, SECRET_FILE_ENV, load_secret

    path = tmp_path / "key"
    assert main(["secret", "--write", str(path)], divert_native_logs=False) == 0
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_secret({SECRET_FILE_ENV: str(path)}) is not None
    assert main(["secret", "--write", str(path)], divert_native_logs=False) == 1  # never overwrites a key
    assert "cannot create" in capsys.readouterr().err
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    assert probe_authentication().status == "ok"
    path.chmod(0o644)  # readable by others: refused, and the doctor says so
    assert probe_authentication().status == "missing"


def test_demo_secret_is_a_private_fresh_key_for_the_block_only(monkeypatch):
    import stat

    from ascend_dist.cli.demo_secret import demo_secret
    from ascend_dist.common.secret import SECRET_ENV, SECRET_FILE_ENV, load_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    with demo_secret():
        path = Path(os.environ[SECRET_FILE_ENV])
        assert load_secret() is not None  # the scenarios' processes inherit a usable key
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert SECRET_FILE_ENV not in os.environ and not path.parent.exists()  # gone with the demo
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)  # an operator's secret is used as it is
    with demo_secret() as source:
        assert SECRET_FILE_ENV not in os.environ and "configured" in source
