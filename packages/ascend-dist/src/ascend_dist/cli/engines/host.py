"""`EngineHost`: start the zygote in the engine environment, fork engines, talk to them with deadlines.

Runs in: the caller's process (tests, the demo). Needs only the standard library and msgspec; the
engines run under ``python``, the engine environment's interpreter (see ``tools/engine_env.py``).
Every wait has a deadline; on one that passes the engine is killed and `EngineError` says what it
was waiting for and where its log is.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ascend_dist.cli.engines.wire import (
    Completion,
    EngineSpec,
    Failure,
    Generate,
    Generated,
    Prompt,
    Ready,
    Spawn,
    Spawned,
    WeightSync,
    WeightSynced,
    WriteModel,
    decode_reply,
    encode,
)

__all__ = ["Engine", "EngineError", "EngineHost", "EngineWeightSync", "WeightSyncError", "engine_python"]

ENGINE_PYTHON_ENV = "ASCEND_DIST_ENGINE_PYTHON"
_WEIGHT_SYNC_GRACE_S = 15.0


class EngineError(RuntimeError):
    """An engine (or the zygote) failed, died, or missed a deadline."""


class WeightSyncError(EngineError):
    """A weight-sync call failed inside the engine; ``reason`` is vLLM's (or our engine's) error.

    The engine is still serving (unless ``reason`` says it exited after a missed deadline).
    """

    def __init__(self, engine: str, method: str, reason: str) -> None:
        """Name the engine, the method and the reason."""
        super().__init__(f"{engine}: {method} failed: {reason}")
        self.method = method
        self.reason = reason


def engine_python() -> str | None:
    """The engine environment's interpreter: ``$ASCEND_DIST_ENGINE_PYTHON``, else None."""
    return os.environ.get(ENGINE_PYTHON_ENV) or None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except (OSError, IndexError):
        return False


class Engine:
    """One running engine: `generate`, `kill` (SIGKILL to its process group), `close`."""

    def __init__(self, name: str, pid: int, conn: socket.socket, log_path: Path, spec: EngineSpec) -> None:
        """Wrap a connected engine (made by `EngineHost.spawn`)."""
        self.name = name
        self.pid = pid
        self.spec = spec
        self.log_path = log_path
        self._conn = conn
        self._stream = conn.makefile("rwb")
        self._lock = threading.Lock()  # one request on the socket at a time (a trainer's relay thread calls too)
        self.start_seconds = 0.0
        self.weight_sync = EngineWeightSync(self)

    def _read(self, deadline: float, waiting_for: str) -> Ready | Generated | WeightSynced | Failure:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise EngineError(f"{self.name}: no answer in time ({waiting_for}); log:\n{_tail(self.log_path)}")
            ready, _, _ = select.select([self._conn], [], [], min(left, 1.0))
            if ready:
                line = self._stream.readline()
                if not line:
                    raise EngineError(f"{self.name} died ({waiting_for}); log:\n{_tail(self.log_path)}")
                reply = decode_reply(line)
                if isinstance(reply, Spawned):
                    raise EngineError(f"{self.name}: unexpected reply {reply!r}")
                return reply
            if not _alive(self.pid):
                raise EngineError(f"{self.name} died ({waiting_for}); log:\n{_tail(self.log_path)}")

    def wait_ready(self, timeout_s: float) -> float:
        """Wait until vLLM is constructed; returns its start-up seconds."""
        reply = self._read(time.monotonic() + timeout_s, "start-up")
        if isinstance(reply, Failure):
            raise EngineError(f"{self.name}: {reply.error}; log:\n{_tail(self.log_path)}")
        if not isinstance(reply, Ready):
            raise EngineError(f"{self.name}: unexpected reply {type(reply).__name__} at start-up")
        self.start_seconds = reply.seconds
        return reply.seconds

    def generate_timed(self, prompts: Sequence[Prompt], timeout_s: float = 120.0) -> Generated:
        """Run ``prompts`` in one batch; the completions and the batch's wall time."""
        with self._lock:
            self._stream.write(encode(Generate(list(prompts), timeout_s)))
            self._stream.flush()
            reply = self._read(time.monotonic() + timeout_s, f"generate of {len(prompts)} prompts")
        if isinstance(reply, Failure):
            raise EngineError(f"{self.name}: {reply.error}")
        if not isinstance(reply, Generated):
            raise EngineError(f"{self.name}: unexpected reply {type(reply).__name__} to generate")
        return reply

    def generate(self, prompts: Sequence[Prompt], timeout_s: float = 120.0) -> list[Completion]:
        """Run ``prompts`` in one batch and return one `Completion` each."""
        return self.generate_timed(prompts, timeout_s).completions

    def call_weight_sync(self, message: WeightSync) -> WeightSynced:
        """Send one `WeightSync` and wait for its answer (the engine's own deadline plus a grace period).

        Raises:
            WeightSyncError: The call failed in the engine (the reason is vLLM's).
            EngineError: The engine died or did not answer in time (then it is killed).
        """
        with self._lock:
            self._stream.write(encode(message))
            self._stream.flush()
            # the engine enforces timeout_s itself and says why; the grace covers its reply
            reply = self._read(time.monotonic() + message.timeout_s + _WEIGHT_SYNC_GRACE_S, message.method)
        if isinstance(reply, Failure):
            raise WeightSyncError(self.name, message.method, reply.error)
        if not isinstance(reply, WeightSynced):
            raise EngineError(f"{self.name}: unexpected reply {type(reply).__name__} to {message.method}")
        return reply

    @property
    def alive(self) -> bool:
        """Whether the engine's process still runs."""
        return _alive(self.pid)

    def kill(self) -> None:
        """SIGKILL the engine and its TP workers at once (as a crashed machine would)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self._close_socket()
        self._wait_gone(10.0)

    def close(self, timeout_s: float = 20.0) -> None:
        """Hang up (the engine exits on EOF), then kill whatever is left after ``timeout_s``."""
        self._close_socket()
        if not self._wait_gone(timeout_s):
            self.kill()

    def _close_socket(self) -> None:
        with contextlib.suppress(OSError):
            self._stream.close()
        with contextlib.suppress(OSError):
            self._conn.close()

    def _wait_gone(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not _alive(self.pid):
                return True
            time.sleep(0.05)
        return not _alive(self.pid)


class EngineWeightSync:
    """vLLM's four weight-sync methods on one engine (the `WeightSyncClient` shape `IpcTrainer` takes).

    Each call goes to the engine's `LLM` as a `WeightSync` message and returns once vLLM returned;
    a failure raises `WeightSyncError` and leaves the engine serving its previous weights.
    """

    def __init__(self, engine: Engine, *, timeout_s: float = 120.0) -> None:
        """Drive ``engine``; every call has the deadline ``timeout_s``."""
        self.engine = engine
        self.timeout_s = timeout_s
        self.last_weight_version: str | None = None

    def _call(self, method: Any, request: dict[str, Any] | None = None, weight_version: str | None = None) -> None:
        reply = self.engine.call_weight_sync(WeightSync(method, request, weight_version, self.timeout_s))
        self.last_weight_version = reply.weight_version

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """``LLM.init_weight_transfer_engine({"init_info": init_info})``."""
        self._call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        """``LLM.start_weight_update()``."""
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """``LLM.update_weights({"update_info": update_info})``."""
        self._call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """``LLM.finish_weight_update(weight_version=...)``."""
        self._call("finish_weight_update", weight_version=weight_version)


class EngineHost:
    """The zygote process and every engine forked from it; a context manager that cleans all up."""

    def __init__(
        self, python: str | None = None, *, workdir: str | Path | None = None, timeout_s: float = 240.0
    ) -> None:
        """Start the zygote under ``python`` (default `engine_python`, else this interpreter).

        Raises:
            EngineError: The zygote could not import vLLM within ``timeout_s``.
        """
        self.python = python or engine_python() or sys.executable
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="ascend-engines-"))
        self.workdir.chmod(0o700)
        self._log = self.workdir / "zygote.log"
        self._log_file: IO[bytes] = open(self._log, "ab")  # noqa: SIM115  (closed in close())
        self._engines: list[Engine] = []
        self._count = 0
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(
            [self.python, "-m", "ascend_dist.cli.engines.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env=env,
            cwd=self.workdir,
        )
        reply = self._request(None, timeout_s, "importing vLLM")
        if not isinstance(reply, Ready):
            raise EngineError(f"zygote: {reply!r}")
        self.vllm_version = reply.detail

    def _request(self, message: Spawn | WriteModel | None, timeout_s: float, what: str) -> Ready | Spawned | Failure:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        if message is not None:
            self._proc.stdin.write(encode(message))
            self._proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if self._proc.poll() is not None:
                raise EngineError(f"the zygote exited ({what}); log:\n{_tail(self._log)}")
            if left <= 0:
                self.close()
                raise EngineError(f"the zygote did not answer in time ({what}); log:\n{_tail(self._log)}")
            ready, _, _ = select.select([self._proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self._proc.stdout.readline()
                if not line:
                    continue  # EOF: poll() reports the exit on the next turn
                reply = decode_reply(line)
                if isinstance(reply, Generated | WeightSynced):
                    raise EngineError(f"zygote: unexpected reply {type(reply).__name__}")
                return reply

    def write_model(
        self,
        path: str | Path,
        seed: int,
        *,
        num_layers: int = 4,
        architecture: str = "llama",
        redraw: str = "",
        redraw_seed: int = 0,
        timeout_s: float = 120.0,
    ) -> Path:
        """Write a tiny random-weight model (`model.write_model`: ``llama`` or ``qwen3_next``) into ``path``.

        ``redraw``/``redraw_seed``: parameters whose names start with ``redraw`` drawn from that seed.
        """
        message = WriteModel(str(path), seed, num_layers, architecture, redraw, redraw_seed)
        reply = self._request(message, timeout_s, f"writing {path}")
        if isinstance(reply, Failure):
            raise EngineError(f"{reply.error}; log:\n{_tail(self._log)}")
        return Path(path)

    def spawn(self, spec: EngineSpec, name: str = "", *, timeout_s: float = 240.0) -> Engine:
        """Fork an engine and wait until it serves.

        Raises:
            EngineError: It failed to start (vLLM's error and the log's tail are in the message).
        """
        self._count += 1
        name = name or f"engine{self._count}"
        sock_path = self.workdir / f"{self._count}.sock"
        log_path = self.workdir / f"{self._count}-{name}.log"
        reply = self._request(Spawn(spec, str(sock_path), str(log_path)), 30.0, f"forking {name}")
        if not isinstance(reply, Spawned):
            raise EngineError(f"{name}: {reply!r}")
        conn = self._connect(sock_path, reply.pid, log_path, name)
        engine = Engine(name, reply.pid, conn, log_path, spec)
        self._engines.append(engine)
        try:
            engine.wait_ready(timeout_s)
        except EngineError:
            engine.kill()
            raise
        return engine

    def _connect(self, path: Path, pid: int, log_path: Path, name: str) -> socket.socket:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            if path.exists():
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    conn.connect(str(path))
                    return conn
                except OSError:
                    conn.close()
            if not _alive(pid):
                break
            time.sleep(0.02)
        raise EngineError(f"{name} never opened its socket; log:\n{_tail(log_path)}")

    def close(self) -> None:
        """Close every engine, then the zygote; remove the work folder if this host made it."""
        for engine in self._engines:
            engine.close()
        self._engines.clear()
        if self._proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        for stream in (self._proc.stdout, self._log_file):
            with contextlib.suppress(OSError, AttributeError):
                stream.close()  # type: ignore[union-attr]
        if self._own_dir:
            import shutil

            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EngineHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
