"""Keep native libraries' log lines (Mooncake's glog output) out of the user's terminal.

Mooncake's transfer engine logs through glog before anyone calls ``InitGoogleLogging``, so its lines
go straight to file descriptor 2 and ignore ``GLOG_minloglevel``; ``MC_LOG_LEVEL`` lowers the volume
but still lets an ERROR line through on every engine start ("Local segment descriptor not found",
which is harmless there). The command therefore puts a pipe behind descriptor 2 for its whole run:
a reader thread copies every line to the real stderr except glog-formatted ones, which go to a log
file the summary names. Child processes inherit the pipe, so their native lines are filtered too.

``ascend-dist -v`` or ``ASCEND_DIST_NATIVE_LOGS=1`` leave stderr untouched.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import BinaryIO

__all__ = ["NATIVE_LOGS_ENV", "NativeLogFilter", "is_native_log_line"]

NATIVE_LOGS_ENV = "ASCEND_DIST_NATIVE_LOGS"

# glog's prefix: severity letter, MMDD, time, thread id, file:line]
_GLOG_LINE = re.compile(rb"^[IWEF]\d{4} \d{2}:\d{2}:\d{2}\.\d+ +\d+ [^ \]]+:\d+\] ")
_GLOG_PREAMBLE = b"WARNING: Logging before InitGoogleLogging() is written to STDERR"


def is_native_log_line(line: bytes) -> bool:
    """Whether `line` was written by glog (a record, or the one preamble glog prints before its first)."""
    return bool(_GLOG_LINE.match(line)) or line.startswith(_GLOG_PREAMBLE)


class NativeLogFilter:
    """Diverts glog lines written to descriptor 2 into `log_path` while active; a context manager."""

    def __init__(self, log_path: Path, *, quiet_after_exit: bool = False) -> None:
        """Prepare to divert into `log_path` (created, with private permissions, on entry).

        `quiet_after_exit`: for a command about to end, descriptor 2 goes to the log file after a clean exit.
        """
        self.log_path = log_path
        self._quiet_after_exit = quiet_after_exit
        self.diverted = 0
        self._saved_fd: int | None = None
        self._reader: threading.Thread | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> NativeLogFilter:
        sys.stderr.flush()
        self.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        log = open(self.log_path, "wb", buffering=0)  # closed by the reader thread
        os.chmod(self.log_path, 0o600)
        read_fd, write_fd = os.pipe()
        self._saved_fd = os.dup(2)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        out = os.fdopen(os.dup(self._saved_fd), "wb", buffering=0)
        self._reader = threading.Thread(
            target=self._pump, args=(os.fdopen(read_fd, "rb", buffering=0), out, log),
            name="native-log-filter", daemon=True,
        )  # fmt: skip
        self._reader.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        sys.stderr.flush()
        assert self._saved_fd is not None
        os.dup2(self._saved_fd, 2)  # drops our write end of the pipe: the reader sees EOF ...
        if self._reader is not None:
            # ... unless a child still holds it; the thread is a daemon, so a lingering child cannot hang exit.
            self._reader.join(timeout=2.0)
        if exc_type is None and self._quiet_after_exit:
            # Native destructors log again at interpreter exit, after our last line: send descriptor 2 to
            # the log file for the rest of the process. Not on an exception, whose traceback is still to print.
            log_fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND)
            os.dup2(log_fd, 2)
            os.close(log_fd)
        os.close(self._saved_fd)

    def _pump(self, pipe: BinaryIO, out: BinaryIO, log: BinaryIO) -> None:
        pending = b""
        try:
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._route(line + b"\n", out, log)
            if pending:
                self._route(pending, out, log)
        finally:
            pipe.close()
            out.close()
            log.close()

    def _route(self, line: bytes, out: BinaryIO, log: BinaryIO) -> None:
        if is_native_log_line(line):
            with self._lock:
                self.diverted += 1
            log.write(line)
        else:
            out.write(line)
