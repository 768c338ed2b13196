"""Child processes that speak JSON lines on stdin/stdout, with a deadline on every read."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class JsonPeer:
    """A `python script.py args` child; `read()` waits at most `timeout` for one JSON line."""

    def __init__(self, script: str, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
        # stderr goes to a file, not a pipe: nobody reads a pipe while the child runs, and a child that
        # logs more than the pipe holds (Mooncake logs there) would block on its next write
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / script), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env,
        )  # fmt: skip
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)

    def read(self, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            if self._selector.select(timeout=max(0.0, deadline - time.monotonic())):
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"peer exited (rc={self.proc.poll()}): {self.stderr_tail()}")
                return json.loads(line)
        raise TimeoutError(f"no reply from peer within {timeout} s: {self.stderr_tail()}")

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self) -> str:
        """The last 2,000 characters the child wrote to stderr so far (running or not)."""
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - 8000))
        return self._stderr.read().decode(errors="replace")[-2000:]

    def close(self, timeout: float = 10.0) -> int | None:
        """Ask the child to quit, then make sure it is gone."""
        try:
            if self.proc.poll() is None:
                self.send({"cmd": "quit"})
                self.proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=timeout)
        finally:
            self._selector.close()
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._stderr.close()
        return self.proc.returncode
