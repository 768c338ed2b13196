"""`NativeLogFilter`: glog lines written to descriptor 2, by us or by a child, go to the log file;
everything else still reaches stderr, in order; a traceback after an error is not swallowed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ascend_dist.cli.native_logs import is_native_log_line

GLOG = "I1203 13:24:27.535246  7918 transfer_engine_impl.cpp:1046] Metrics reporting is disabled"


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(
        f"""
        import os, subprocess, sys
        from pathlib import Path
        from ascend_dist.cli.native_logs import NativeLogFilter
        log = Path({str(tmp_path / "logs" / "native.log")!r})
        GLOG = {GLOG!r}
        """
    ) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)


def test_glog_lines_recognised_and_others_not() -> None:
    assert is_native_log_line(GLOG.encode())
    assert is_native_log_line(b"E1203 13:25:07.318192  8574 transfer_metadata.cpp:1098] Local segment descriptor")
    assert is_native_log_line(b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
    assert not is_native_log_line(b"[   0.6s] pool: 1/4\n")
    assert not is_native_log_line(b"Traceback (most recent call last):\n")
    assert not is_native_log_line(b"I think 1203 is a number\n")


def test_native_lines_from_us_and_a_child_go_to_the_log(tmp_path: Path) -> None:
    done = _run(
        tmp_path,
        """
        with NativeLogFilter(log, quiet_after_exit=True) as f:
            print("ours before", file=sys.stderr, flush=True)
            os.write(2, (GLOG + "\\n").encode())
            child = f"import os; os.write(2, b'{GLOG}\\\\nchild plain\\\\n')"
            subprocess.run([sys.executable, "-c", child], check=True)
            print("ours after", file=sys.stderr, flush=True)
        os.write(2, (GLOG + " at exit\\n").encode())
        print("diverted", f.diverted)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == ["ours before", "child plain", "ours after"]
    kept = (tmp_path / "logs" / "native.log").read_text().splitlines()
    assert kept == [GLOG, GLOG, GLOG + " at exit"]
    assert done.stdout.strip() == "diverted 2"
    assert (tmp_path / "logs" / "native.log").stat().st_mode & 0o777 == 0o600


def test_an_error_inside_keeps_its_traceback_on_stderr(tmp_path: Path) -> None:
    done = _run(
        tmp_path,
        """
        with NativeLogFilter(log, quiet_after_exit=True):
            os.write(2, (GLOG + "\\n").encode())
            raise RuntimeError("boom inside the command")
        """,
    )
    assert done.returncode == 1
    assert "RuntimeError: boom inside the command" in done.stderr
    assert GLOG not in done.stderr
