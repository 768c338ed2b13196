"""``vllm serve`` instances and the demo proxy as subprocesses: start, wait for health, ask, read /metrics, stop.

Runs in: the caller's process (the demo, the engine tier). Only the standard library; the servers
run under the engine environment's Python through `serve_launch` (vLLM's own CLI). Every process
binds 127.0.0.1 on a free port, runs in its own process group (killed whole at `ServeStack.close`,
and by the kernel if the caller dies), and every wait has a deadline. `ServeStack.commands` are the
exact command lines it ran, environment included, for an operator to copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ascend_dist.cli.engines.host import EngineError
from ascend_dist.cli.engines.pd import pull_connector_config
from ascend_dist.cli.engines.wire import Completion

__all__ = [
    "SERVER_PORTS",
    "SERVE_ENV",
    "Launch",
    "ServeStack",
    "Server",
    "complete",
    "free_port",
    "metric_total",
    "transfer_stats_lines",
]

SERVE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: the tiny model needs little
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # several instances share this host's cores: see below
}
"""The environment every ``vllm serve`` here gets on top of the caller's (offline, no usage stats).

``VLLM_CPU_OMP_THREADS_BIND=nobind``: vLLM's automatic binding gives each instance all the host's
cores and binds every instance's forward thread to the first one. While P lends blocks its engine
steps without pause and its forward thread waits for each step with ``sched_yield``; the kernel
(EEVDF) then lets it hold that core whole, so D's forward thread, bound there too, does not run
until P's lease frees the blocks: D's engine stalls 60 s and its pull finds the blocks gone (CI,
every 256-token prompt of ``test_serve.py`` on 2026-12-05; reproduced here by leaving requests lent
on P). Unbound, the threads move to the other core and no pull stalled. A deployment gives each
instance its own cores and keeps the binding (kv-mooncake README, failure table).
"""

SIDE_CHANNEL = {"rpc_timeout_s": 10.0, "rpc_retries": 3}
"""D's side-channel deadlines here (default 1 s x 2): room for four ``vllm serve`` on a loaded 2-core
machine. The timeouts of the first runs were not the deadline but threads confined to the forward
thread's core (fixed in kv-mooncake's `PullWorker`; README, operator section)."""

MODEL_NAME = "tiny"
_STATS_PREFIX = "vllm:mooncake_"  # our pull connector's p2p channel uses vLLM's Mooncake metric names
_PR_SET_PDEATHSIG = 1
_HTTP_ERRORS = (OSError, http.client.HTTPException)  # refused, reset, timed out, or a garbled answer


SERVER_PORTS = range(10000, 15000)
"""Where the stack draws its servers' ports: below Mooncake's own draw (15000-16999) and the
kernel's ephemeral ports (32768 and up). A port the kernel handed out is bound by its server only a
minute later (P's worker binds its side channel after the model loaded), and meanwhile every
server's vLLM, gloo and Mooncake take ephemeral ports: one start lost its side-channel port so."""


def free_port() -> int:
    """A port of `SERVER_PORTS` free on 127.0.0.1 now.

    Raises:
        EngineError: None found in 200 draws.
    """
    for _ in range(200):
        port = SERVER_PORTS[secrets.randbelow(len(SERVER_PORTS))]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise EngineError(f"no free port in {SERVER_PORTS} on 127.0.0.1")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True)
class Launch:
    """One command line: its argv and the environment variables it adds to the caller's."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """The command as a shell line (``K=V ... argv``)."""
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), shlex.join(self.argv)])


def _request(url: str, method: str, path: str, payload: Any, timeout_s: float) -> tuple[int, bytes]:
    host, _, port = url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)  # direct: no proxy variables
    try:
        body = json.dumps(payload).encode() if payload is not None else None
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Server:
    """One subprocess serving HTTP on ``url``; its output goes to ``log_path``."""

    def __init__(self, name: str, launch: Launch, url: str, log_path: Path) -> None:
        """Start it (returns at once; `wait_ready` waits for its health endpoint)."""
        self.name = name
        self.launch = launch
        self.url = url
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115  (closed in stop())
        self._proc = subprocess.Popen(
            launch.argv,
            env={**os.environ, **launch.env},
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() kills vLLM's engine core with it
            preexec_fn=_die_with_parent,  # noqa: PLW1509  (prctl only; no locks taken)
        )

    def tail(self, lines: int = 30) -> str:
        """The last lines of its log."""
        return self._last(lines, lambda line: True)

    def matching(self, *needles: str, lines: int = 20) -> str:
        """The last ``lines`` lines of its log holding any of ``needles`` (why a request failed, say)."""
        return self._last(lines, lambda line: any(n in line for n in needles))

    def _last(self, lines: int, keep: Callable[[str], bool]) -> str:
        """The last ``lines`` lines of its log that ``keep`` accepts."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join([line for line in text if keep(line)][-lines:])

    @property
    def alive(self) -> bool:
        """Whether the process still runs."""
        return self._proc.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        """Wait until ``GET /health`` answers 200.

        Raises:
            EngineError: It exited or missed the deadline (then it is stopped); the log's tail is in the message.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise EngineError(f"{self.name} exited with {self._proc.returncode}; log:\n{self.tail()}")
            with contextlib.suppress(*_HTTP_ERRORS):
                if _request(self.url, "GET", "/health", None, 5.0)[0] == 200:
                    return
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"{self.name} was not healthy within {timeout_s} s; log:\n{self.tail()}")

    def post(self, path: str, payload: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """POST JSON, return the JSON answer.

        Raises:
            EngineError: Not a 200 answer with a JSON object, or no answer within ``timeout_s``.
        """
        try:
            status, raw = _request(self.url, "POST", path, payload, timeout_s)
        except _HTTP_ERRORS as exc:  # TimeoutError included
            raise EngineError(f"{self.name}: POST {path}: {exc}") from exc
        if status != 200:
            raise EngineError(f"{self.name}: POST {path} answered {status}: {raw[:500].decode(errors='replace')}")
        try:
            answer = json.loads(raw)
        except ValueError as exc:
            raise EngineError(f"{self.name}: POST {path} answered something other than JSON") from exc
        if not isinstance(answer, dict):
            raise EngineError(f"{self.name}: POST {path} answered a non-object")
        return answer

    def metrics(self, timeout_s: float = 10.0) -> str:
        """The Prometheus text of ``GET /metrics``.

        Raises:
            EngineError: Not a 200 answer.
        """
        try:
            status, raw = _request(self.url, "GET", "/metrics", None, timeout_s)
        except _HTTP_ERRORS as exc:
            raise EngineError(f"{self.name}: GET /metrics: {exc}") from exc
        if status != 200:
            raise EngineError(f"{self.name}: GET /metrics answered {status}")
        return raw.decode(errors="replace")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM its process group, SIGKILL what is left after ``grace_s``; close the log."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=wait_s)
                if sig is signal.SIGTERM:  # the leader is gone: make sure its children are too
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(self._proc.pid, signal.SIGKILL)
                break
        with contextlib.suppress(OSError):
            self._log.close()


def complete(server: Server, prompt: Sequence[int], *, max_tokens: int = 8, timeout_s: float = 120.0) -> Completion:
    """One OpenAI completion of token ids, greedy (temperature 0), with the sampled tokens' logprobs.

    Raises:
        EngineError: The server failed, or its answer lacks the token ids.
    """
    answer = server.post(
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,  # the random model's EOS may come first; the check needs every token
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # no tokenizer (--skip-tokenizer-init)
        },
        timeout_s,
    )
    try:
        choice = answer["choices"][0]
        token_ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineError(f"{server.name}: unexpected completion {json.dumps(answer)[:300]}") from exc
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=choice.get("finish_reason"),
        kv_transfer_params=answer.get("kv_transfer_params"),
    )


def _samples(text: str) -> list[tuple[str, str]]:
    """``(name, line)`` of every sample line of a Prometheus text page."""
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            out.append((line.split("{", 1)[0].split(" ", 1)[0], line))
    return out


def metric_total(text: str, name: str) -> float:
    """The sum of ``name``'s samples over all label sets (0 when absent)."""
    return sum(float(line.rsplit(" ", 1)[1]) for n, line in _samples(text) if n == name)


def transfer_stats_lines(text: str) -> list[str]:
    """Our p2p transfer stats on a /metrics page: sums, counts and failure counters (no buckets)."""
    keep = ("_sum", "_count", "_total")
    return [line for n, line in _samples(text) if n.startswith(_STATS_PREFIX) and n.endswith(keep)]


@dataclass
class ServeStack:
    """The processes of one walkthrough; `close` stops them all (also on errors: use it as a context manager).

    Attributes:
        python: The engine environment's interpreter (runs `serve_launch`).
        workdir: Where the logs go.
        cache_root: ``VLLM_CACHE_ROOT`` of every server (vLLM caches its model inspection there: the
            first start under a fresh root spends minutes on it, so then the first ``vllm serve``
            is waited for before the next starts, which reads the cache instead of inspecting too).
        start_timeout_s: Deadline of that wait.
    """

    python: str
    workdir: Path
    cache_root: Path
    start_timeout_s: float = 900.0
    servers: list[Server] = field(default_factory=list)
    _inspecting: Server | None = field(default=None, init=False, repr=False)

    def _inspection_cached(self) -> bool:
        # vLLM's file name for the Llama class's cached inspection (registry._LazyRegisteredModel)
        return any((self.cache_root / "modelinfos").glob("*-LlamaForCausalLM.json"))

    @property
    def commands(self) -> list[str]:
        """Every command line started so far, in order."""
        return [s.launch.shell() for s in self.servers]

    def _start(self, name: str, launch: Launch, port: int) -> Server:
        server = Server(name, launch, f"http://127.0.0.1:{port}", self.workdir / f"{len(self.servers) + 1}-{name}.log")
        self.servers.append(server)
        return server

    def start_vllm(self, name: str, model: Path, *, role: str | None = None, engine_id: str = "") -> Server:
        """``vllm serve model`` (with `MooncakeConnectorV1` as ``role`` unless None); not yet waited for.

        Raises:
            EngineError: The first server, inspecting the model under a cold cache, failed to start.
        """
        if self._inspecting is not None and not self._inspection_cached():
            self._inspecting.wait_ready(self.start_timeout_s)
        port = free_port()
        argv = [self.python, "-m", "ascend_dist.cli.engines.serve_launch", "serve", str(model),
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
                "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16", "--seed", "0",
                "--enforce-eager", "--skip-tokenizer-init", "--no-enable-prefix-caching"]  # fmt: skip
        if role is not None:
            config = pull_connector_config(
                "MooncakeConnectorV1", role, engine_id=engine_id, kv_port=free_port(), extra=SIDE_CHANNEL
            )
            argv += ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]
        env = {**SERVE_ENV, "VLLM_CACHE_ROOT": str(self.cache_root)}
        server = self._start(name, Launch(tuple(argv), env), port)
        if self._inspecting is None and not self._inspection_cached():
            self._inspecting = server
        return server

    def start_proxy(self, name: str, prefill_url: str, decode_url: str) -> Server:
        """The demo proxy (`serve_proxy`) in front of P and D (their base URLs); not yet waited for."""
        port = free_port()
        argv = (sys.executable, "-m", "ascend_dist.cli.engines.serve_proxy", "--prefill", prefill_url,
                "--decode", decode_url, "--port", str(port))  # fmt: skip
        return self._start(name, Launch(argv), port)

    def wait_ready(self, servers: Sequence[Server], timeout_s: float) -> None:
        """Wait for each of ``servers`` (one deadline for all).

        Raises:
            EngineError: One exited or missed the deadline.
        """
        deadline = time.monotonic() + timeout_s
        for server in servers:
            server.wait_ready(max(1.0, deadline - time.monotonic()))

    def stop(self, server: Server) -> None:
        """Stop one server now (it stays in `commands`)."""
        server.stop()

    def close(self) -> None:
        """Stop every process, proxies first."""
        for server in reversed(self.servers):
            server.stop()

    def __enter__(self) -> ServeStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
