"""Start and drive a peer child (P instances) with a deadline on every reply.

Runs in: the ``pd``, ``pd-layerwise`` and ``pd-sfa`` scenarios and the tests (the parent side). The
child is a JSON-lines server (`pd_peer`, `layerwise.peer` or `sfa.peer`, see `peer_serve`); it is
always terminated, then killed if needed, by `PeerProcess.close`.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import closing
from types import TracebackType
from typing import Any, Self, TypeVar

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, ProtocolError
from ascend_dist.kv_mooncake.core.tcp_sockets import ports_in_use

__all__ = [
    "RPC_PORT_WINDOWS",
    "STDERR_LINES_KEPT",
    "DInstance",
    "PInstance",
    "PeerProcess",
    "free_port_range",
    "fresh_rpc_ports",
    "start_on_same_port",
    "wait_ports_released",
]

T = TypeVar("T")

STDERR_LINES_KEPT = 400
"""How many of the child's latest log lines a `PeerProcess` keeps (for the error it raises)."""

RPC_PORT_WINDOWS = range(20000, 32768, 4)
"""Where children's Mooncake engines draw their ports: each child its own window of 4, never one an
earlier child of this process had. Mooncake keeps a peer's descriptor per session name for the life
of the reading process (`core.session_owners`): a P child that drew a dead one's RPC port (one in
2,000 by Mooncake's own draw) would not be readable by this process's D. Mooncake takes its RPC
port and its TCP transport's port from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT`` and ignores a
range reaching past 32767 (measured with 0.3.13); below the kernel's ephemeral ports, away from
Mooncake's own range (15000-16999)."""

_first_window = secrets.randbelow(len(RPC_PORT_WINDOWS))  # processes start apart
_next_window = itertools.count(_first_window)
_window_lock = threading.Lock()


def fresh_rpc_ports() -> tuple[int, int]:
    """The next window of `RPC_PORT_WINDOWS` none of whose ports is in use (first and last port).

    Mooncake binds its transport without ``SO_REUSEADDR``: a port a dead process closed
    connections on first stays unbindable for 60 s (TIME_WAIT), so such a window is passed over.

    Raises:
        ConfigError: This process went through every window.
    """
    while True:
        with _window_lock:
            index = next(_next_window)
        if index >= _first_window + len(RPC_PORT_WINDOWS):  # never a window twice
            raise ConfigError("MC_MIN_RPC_PORT", None, f"a window of {RPC_PORT_WINDOWS} no earlier peer child had")
        first = RPC_PORT_WINDOWS[index % len(RPC_PORT_WINDOWS)]
        window = range(first, first + RPC_PORT_WINDOWS.step)
        if not ports_in_use(window):
            return window[0], window[-1]


def wait_ports_released(ports: Iterable[int], timeout_s: float = 120.0) -> None:
    """Wait until no socket of this namespace has one of ``ports`` as its own (TIME_WAIT included).

    A killed peer's ports stay held while its connections wind down in the kernel (TIME_WAIT, or
    FIN_WAIT2 while the other side keeps its end open: Mooncake pools connections to dead peers),
    60 s each; a child meant to take one of them again waits here first.

    Raises:
        DeadlineExceeded: Still in use after ``timeout_s``.
    """
    wanted = list(ports)
    deadline = time.monotonic() + timeout_s
    while ports_in_use(wanted):
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"ports {wanted} still in use after {timeout_s} s")
        time.sleep(1.0)


def start_on_same_port(start: Callable[[], T], timeout_s: float = 10.0) -> T:
    """``start()`` again while it fails for its port in use, until ``timeout_s``: an instance restarted on its ports.

    Test ports come from the kernel's ephemeral range, so while a dead instance's port is free a
    peer reconnecting to it can, now and then, take it as its own source port (a connection to
    itself) until its socket gives up a moment later: the restart then finds it in use.

    Raises:
        ConfigError: Still in use after ``timeout_s`` (or any other configuration error, at once).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return start()
        except ConfigError as exc:
            if exc.field != "port" or time.monotonic() > deadline:
                raise
        time.sleep(0.2)


def free_port_range(count: int, host: str = "127.0.0.1", attempts: int = 50) -> int:
    """A base port whose next ``count`` ports are all free now (bound and released to check)."""
    for _ in range(attempts):
        with closing(socket.socket()) as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ConfigError("kv_port", None, f"{count} consecutive free ports on {host}")


class PeerProcess:
    """A ``python -m <module>`` child speaking JSON lines (the pull's `pd_peer` by default)."""

    def __init__(
        self,
        *,
        module: str = "ascend_dist.kv_mooncake._demo.pd_peer",
        ready_timeout_s: float = 60.0,
        launcher: Sequence[str] = (),
        unset_env: Sequence[str] = (),
        rpc_ports: tuple[int, int] | None = None,
    ) -> None:
        """Start ``python -m module`` and wait until it reports ready.

        ``launcher``: a command that execs the rest of its arguments (``ip netns exec NAME``: the
        child then runs in that network namespace; the child's pid stays the one we started).
        ``unset_env``: variables the child must not inherit (``VLLM_HOST_IP``: find its own address).
        ``rpc_ports``: the first and last port its Mooncake engine may take (for its RPC port and
        its transport's; default: a window no earlier child had, `RPC_PORT_WINDOWS`).
        """
        first, last = rpc_ports or fresh_rpc_ports()
        env = {k: v for k, v in os.environ.items() if k not in unset_env} | {
            "GLOG_minloglevel": "2",
            "MC_MIN_RPC_PORT": str(first),
            "MC_MAX_RPC_PORT": str(last),
        }
        self.proc = subprocess.Popen(
            [*launcher, sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        # The child's log is read as it comes: a pipe nobody reads fills at 64 KiB and then blocks
        # the child inside its next log call (a chaos run logs a line per failed request).
        self._stderr_tail: deque[str] = deque(maxlen=STDERR_LINES_KEPT)
        self._stderr_reader = threading.Thread(target=self._read_stderr, name="peer-stderr", daemon=True)
        self._stderr_reader.start()
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            reply = self.read(ready_timeout_s)
            if not reply.get("ready"):
                raise ProtocolError(f"peer did not start: {reply}")
        except BaseException:
            self.close()
            raise

    def send(self, msg: dict[str, Any]) -> None:
        """Write one JSON line."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Read one JSON line within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            if self._sel.select(timeout=max(0.0, deadline - time.monotonic())):
                line = self.proc.stdout.readline()
                if not line:
                    raise ProtocolError(f"peer exited (rc={self.proc.poll()}): {self._stderr()}")
                return json.loads(line)
        raise DeadlineExceeded(f"no reply from the P peer within {timeout_s} s")

    def call(self, msg: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
        """Send a command and return its reply."""
        self.send(msg)
        reply = self.read(timeout_s)
        if "error" in reply:
            raise ProtocolError(f"peer: {reply['error']}")
        return reply

    def create(self, name: str, config: dict[str, Any], model: dict[str, Any], ranks: Sequence[int] = ()) -> PInstance:
        """Create a producer instance in the child (only ``ranks`` of it when given: the rest run elsewhere)."""
        msg = {"cmd": "create", "name": name, "config": config, "model": model, "ranks": list(ranks)}
        self.call(msg, timeout_s=60.0)
        return PInstance(self, name)

    def create_consumer(self, name: str, config: dict[str, Any], model: dict[str, Any]) -> DInstance:
        """Create a consumer (D) instance in the child (`pd_peer` only)."""
        msg = {"cmd": "create", "name": name, "config": config, "model": model, "role": "consumer"}
        self.call(msg, timeout_s=60.0)
        return DInstance(self, name)

    def _read_stderr(self) -> None:
        """Keep the child's latest log lines (ends at the child's exit: end of the pipe)."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr_tail.append(line)

    def log_tail(self) -> str:
        """The child's latest log lines (up to `STDERR_LINES_KEPT`)."""
        return "".join(list(self._stderr_tail))

    def _stderr(self) -> str:
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "(still running)"
        self._stderr_reader.join(timeout=5.0)
        return self.log_tail()[-2000:]

    def kill(self) -> None:
        """SIGKILL the child (a P that dies)."""
        self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the child to quit; terminate or kill it if it does not. Idempotent."""
        try:
            if self.proc.poll() is None:
                self.send({"cmd": "quit"})
                self.proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
        finally:
            self._sel.close()
            self._stderr_reader.join(timeout=timeout_s)  # the child is gone: its pipe has ended
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class PInstance:
    """One P instance inside a `PeerProcess`."""

    def __init__(self, peer: PeerProcess, name: str) -> None:
        """Bind to an instance created by `PeerProcess.create`."""
        self.peer = peer
        self.name = name

    def prefill(
        self, rid: str, prompt_len: int, seed: int, *, end: str = "length", preempt: bool = False
    ) -> dict[str, Any]:
        """Run a prefill ending as ``end`` (``length``, ``stopped``, ``aborted``); return P's kv_transfer_params.

        ``preempt``: vLLM preempts it after its first step and schedules it again into other blocks.
        """
        msg = {"cmd": "prefill", "name": self.name, "rid": rid, "prompt_len": prompt_len, "seed": seed}
        return self.peer.call({**msg, "end": end, "preempt": preempt})["params"]

    def prefill_many(
        self, rids: list[str], prompt_len: int, seed: int, seeds: Sequence[int] = ()
    ) -> list[dict[str, Any]]:
        """Run several prefills in one round trip (``seeds``: one each, else ``seed`` for all); return their params."""
        msg = {"cmd": "prefill_many", "name": self.name, "rids": rids, "prompt_len": prompt_len, "seed": seed}
        msg["seeds"] = list(seeds)
        return self.peer.call(msg, timeout_s=120.0)["params"]

    def addresses(self) -> list[tuple[str, int]]:
        """Each local P rank's ``(host, port)`` (the handshake metadata vLLM gathers from workers)."""
        return [(str(h), int(p)) for h, p in self.peer.call({"cmd": "addresses", "name": self.name})["addresses"]]

    def set_addresses(self, addresses: Sequence[tuple[str, int]]) -> list[str]:
        """Hand every P worker's address to this instance's scheduler; returns its port -> host map."""
        msg = {"cmd": "set_addresses", "name": self.name, "addresses": [list(a) for a in addresses]}
        return list(self.peer.call(msg)["rank_hosts"])

    def mooncake_ports(self) -> tuple[int, list[int]]:
        """The instance's Mooncake RPC port (its session's) and transport ports."""
        reply = self.peer.call({"cmd": "engine", "name": self.name})
        return int(str(reply["session"]).rsplit(":", 1)[1]), [int(p) for p in reply["transport_ports"]]

    def poll(self) -> dict[str, Any]:
        """Collect finished sends, free their blocks; return P's counters."""
        return self.peer.call({"cmd": "poll", "name": self.name})

    def drop(self) -> None:
        """Shut the instance down (no-op if the process is gone)."""
        if self.peer.proc.poll() is None:
            self.peer.call({"cmd": "drop", "name": self.name})


class DInstance:
    """One D instance inside a `PeerProcess` (a D that must run elsewhere, e.g. in a network namespace)."""

    def __init__(self, peer: PeerProcess, name: str) -> None:
        """Bind to an instance created by `PeerProcess.create_consumer`."""
        self.peer = peer
        self.name = name
        self.blocks: dict[str, list[list[int]]] = {}
        """D's block ids of each request queued here (per KV-cache group)."""

    def _call(self, cmd: str, timeout_s: float = 30.0, **fields: Any) -> dict[str, Any]:
        return self.peer.call({"cmd": cmd, "name": self.name, **fields}, timeout_s=timeout_s)

    def decode(self, rid: str, prompt_len: int, params: dict[str, Any], computed_tokens: int = 0) -> int:
        """Accept P's params and queue the pull; return the tokens to load (D's block ids: `blocks`)."""
        reply = self._call("decode", rid=rid, prompt_len=prompt_len, params=params, computed=computed_tokens)
        self.blocks[rid] = [[int(b) for b in ids] for ids in reply["blocks"]]
        return int(reply["count"])

    def recv_poll(self) -> tuple[set[str], set[int]]:
        """Requests every D rank finished receiving since the last poll, and the load-error block ids."""
        reply = self._call("recv_poll")
        return set(reply["recv"]), set(reply["errors"])

    def wait_recv(self, rids: set[str], timeout_s: float) -> set[int]:
        """Poll until every request in ``rids`` finished receiving; return the load errors seen.

        Raises:
            DeadlineExceeded: Some request did not finish within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        pending, errors = set(rids), set[int]()
        while pending:
            recv, errs = self.recv_poll()
            errors |= errs
            pending -= recv
            if pending and time.monotonic() > deadline:
                raise DeadlineExceeded(f"D: requests {sorted(pending)[:4]} not received within {timeout_s} s")
            if pending:
                time.sleep(0.005)
        return errors

    def verify(self, rid: str, seed: int, computed_tokens: int = 0) -> int:
        """Check every pulled byte against P's pattern; return bytes checked.

        Raises:
            ProtocolError: A byte differs (the child's ``AssertionError``, naming layer and rank).
        """
        return int(self._call("verify", timeout_s=60.0, rid=rid, seed=seed, computed=computed_tokens)["bytes"])

    def digest(self, rid: str) -> str:
        """SHA-256 of the request's blocks on D (whether anything wrote into them meanwhile)."""
        return str(self._call("digest", rid=rid)["sha256"])

    def finish(self, rid: str) -> None:
        """The request finished on D: free its blocks."""
        self._call("finish", rid=rid)
        self.blocks.pop(rid, None)

    def state(self) -> dict[str, int]:
        """What D still holds, its engine's reads and the process's threads and fds.

        Keys: ``pulling``, ``quarantined``, ``tracked``, ``blocks_held``, ``engine_pieces`` (pieces
        of reads not yet returned), ``threads``, ``fds``.
        """
        return {k: int(v) for k, v in self._call("d_state").items()}

    def drop(self) -> None:
        """Shut the instance down (no-op if the process is gone)."""
        if self.peer.proc.poll() is None:
            self._call("drop")
