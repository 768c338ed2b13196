"""Start and stop a local ``mooncake_master`` bound to 127.0.0.1 (demo, bench, tests).

Runs in: the ``ascend-dist demo/bench`` process. The master ships in the Mooncake wheel (on the
venv's PATH); it needs ``libibverbs.so.1`` even for TCP. Every wait is bounded and `stop` always
reaps the child (SIGINT, then SIGKILL).
"""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from ascend_dist.common.errors import DeadlineExceeded, StoreError

__all__ = ["MasterProcess", "free_port"]


def _die_with_parent() -> None:
    """Child-side: ask Linux to SIGKILL the master when its parent dies (no orphan on a crash)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """An OS-assigned free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MasterProcess:
    """A ``mooncake_master`` child on free loopback ports."""

    def __init__(self, *, lease_ttl_ms: int = 500, log_path: Path | None = None) -> None:
        """Pick ports; nothing starts until `start`."""
        self.port = free_port()
        self.metrics_port = free_port()
        self._ttl = lease_ttl_ms
        self._log = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:port`` of the master's RPC server."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> None:
        """Start the master and wait until it listens on its RPC and its metrics port.

        The metrics server comes up after the RPC server: under load a caller reading the metrics
        right after the RPC port answered was refused (the engine tier's pool-fault tests).

        Raises:
            StoreError: ``mooncake_master`` is not installed or exited.
            DeadlineExceeded: It did not listen within ``timeout_s``.
        """
        local = Path(sys.executable).parent / "mooncake_master"
        exe = str(local) if local.exists() else shutil.which("mooncake_master")
        if exe is None:
            raise StoreError("mooncake_master not found: install ascend-dist-kv-store[cpu] (and libibverbs1)")
        out = self._log.open("ab") if self._log is not None else subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                [exe, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1",
                 f"--metrics_port={self.metrics_port}", "--enable_metric_reporting=false",
                 f"--default_kv_lease_ttl={self._ttl}"],
                stdout=out, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,  # noqa: PLW1509
            )  # fmt: skip
        finally:
            if self._log is not None and out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        waiting = [self.port, self.metrics_port]
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise StoreError(f"mooncake_master exited with {self._proc.returncode} (missing libibverbs.so.1?)")
            try:
                with socket.create_connection(("127.0.0.1", waiting[0]), timeout=0.2):
                    waiting.pop(0)
                    if not waiting:
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise DeadlineExceeded(
            f"mooncake_master did not listen on 127.0.0.1 ports {waiting} (RPC {self.port}, metrics "
            f"{self.metrics_port}) within {timeout_s}s"
        )

    def exit_status(self) -> int | None:
        """The return code of a master that was started and exited on its own; None while it runs (or stopped)."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the master's log (empty without a log file)."""
        if self._log is None or not self._log.exists():
            return ""
        return self._log.read_text(errors="replace")[-chars:]

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the master (SIGINT, then SIGKILL) and reap it. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)

    def kill(self, timeout_s: float = 10.0) -> None:
        """SIGKILL the master and reap it: a crash, for fault tests (clients get no goodbye). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(timeout=timeout_s)

    def __enter__(self) -> MasterProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
