"""The ``pd-vllm`` bench's P in a process of its own: its main thread is P's engine loop.

Runs in: a child of the ``ascend-dist bench`` process, started by `pd_vllm_p_host.ProcessP` (``python
-m``). JSON lines, never pickle: ``{"ready": true}`` first, then one reply per command read from
stdin:

* ``start`` (model_dir, shape, transfer, env, gloo_port) -> builds P (`pd_vllm_driver.Instance`);
* ``fill`` (seed) -> P's caches from a seeded generator;
* ``prefill`` (req_ids, prompts, params, timeout_s) -> ``blocks`` and ``params`` per finished request;
* ``digests`` (blocks) -> ``digests`` per request (`Instance.digests`);
* ``idle`` (timeout_s) -> answered once P's scheduler has no work;
* ``quit`` or end of input -> P shut down, the process gone.

The loop is vLLM's ``EngineCore`` busy loop in shape: commands come in on a reader thread (vLLM's
input socket thread), and while the scheduler has work (P's finished requests hold blocks until
D's reads are done) the main thread steps it, pausing 0.5 ms between steps as the one-process
bench's `Instance.run_until_idle` does; with no work it waits for the next command. vLLM logs to
stdout, so the replies go to a private copy of it and stdout itself to stderr.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

STEP_PAUSE_S = 0.0005
IDLE_POLL_S = 0.2


class _Replies:
    """The protocol's own stream: a duplicate of fd 1 taken before fd 1 is pointed at stderr."""

    def __init__(self) -> None:
        self._out: IO[str] = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # vLLM's logging (and any print) now lands in the log, not in the protocol

    def send(self, obj: dict[str, Any]) -> None:
        self._out.write(json.dumps(obj) + "\n")
        self._out.flush()


def _read_commands(inbox: queue.Queue[dict[str, Any] | None]) -> None:
    try:
        for line in sys.stdin:
            inbox.put(json.loads(line))
    finally:
        inbox.put(None)  # end of input: the loop shuts P down


class _EngineLoop:
    """P stepped while it has work; commands answered between steps."""

    def __init__(self, replies: _Replies, inbox: queue.Queue[dict[str, Any] | None]) -> None:
        self._replies = replies
        self._inbox = inbox
        self._inst: Any = None  # pd_vllm_driver.Instance once started (vLLM is imported on start)
        self._idle_deadline: float | None = None  # an `idle` command waiting for P to have no work

    def run(self, stack: ExitStack) -> None:
        while True:
            busy = self._inst is not None and self._inst.sched.has_requests()
            try:
                msg = self._inbox.get_nowait() if busy else self._inbox.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                msg = {}
            if msg is None or msg.get("cmd") == "quit":
                return
            if msg:
                self._answer(msg, stack)
            if self._inst is not None and self._inst.sched.has_requests():
                self._inst.step()
                time.sleep(STEP_PAUSE_S)
            self._answer_idle()

    def _answer(self, msg: dict[str, Any], stack: ExitStack) -> None:
        try:
            reply = self._handle(msg, stack)
        except Exception as exc:  # a bad command is reported; P keeps running
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        if reply is not None:
            self._replies.send(reply)

    def _handle(self, msg: dict[str, Any], stack: ExitStack) -> dict[str, Any] | None:
        cmd = msg.get("cmd")
        if cmd == "start":
            self._inst = _start(msg, stack)
            return {"ok": True}
        if self._inst is None:
            return {"error": f"{cmd!r} before start"}
        if cmd == "idle":
            self._idle_deadline = time.monotonic() + float(msg["timeout_s"])
            return None  # answered by `_answer_idle`
        handler = _COMMANDS.get(str(cmd))
        return handler(self._inst, msg) if handler is not None else {"error": f"unknown cmd {cmd!r}"}

    def _answer_idle(self) -> None:
        if self._idle_deadline is None:
            return
        if not self._inst.sched.has_requests():
            self._idle_deadline = None
            self._replies.send({"ok": True})
        elif time.monotonic() > self._idle_deadline:
            self._idle_deadline = None
            self._replies.send({"error": "DeadlineExceeded: P's scheduler still had work"})


def _prefill(inst: Any, msg: dict[str, Any]) -> dict[str, Any]:
    blocks, params = inst.prefill(msg["req_ids"], msg["prompts"], msg["params"], float(msg["timeout_s"]))
    return {"blocks": blocks, "params": params}


_COMMANDS: dict[str, Callable[[Any, dict[str, Any]], dict[str, Any]]] = {
    "fill": lambda inst, msg: inst.fill_random(int(msg["seed"])) or {"ok": True},
    "prefill": _prefill,
    "digests": lambda inst, msg: {"digests": inst.digests(msg["blocks"])},
}
"""The commands P answers at once (``start`` and ``idle`` are the loop's own)."""


def _start(msg: dict[str, Any], stack: ExitStack) -> Any:
    """Build P as the one-process bench does, its shims and vLLM world held until the process ends."""
    from ascend_dist.kv_mooncake._demo import pd_vllm_driver as vd
    from ascend_dist.kv_mooncake._demo.pd_vllm_geometry import Shape

    shape = Shape(**msg["shape"])
    config = vd.vllm_config(Path(msg["model_dir"]), shape, msg["transfer"])
    stack.enter_context(vd.environment(msg["env"]))
    stack.enter_context(vd.cpu_host_shims())
    stack.enter_context(vd.distributed_env(config, int(msg["gloo_port"])))
    inst = vd.Instance(config, shape)
    stack.callback(inst.close)
    return inst


def main() -> int:
    """Serve until ``quit`` or end of input, then shut P down."""
    replies = _Replies()
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    reader = threading.Thread(target=_read_commands, args=(inbox,), name="p-commands", daemon=True)
    reader.start()
    replies.send({"ready": True})
    with ExitStack() as stack:
        _EngineLoop(replies, inbox).run(stack)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # vLLM 0.33's MooncakeConnectorWorker leaves its sender loop running after shutdown: skip the
    # interpreter's teardown, which would wait on it (the test of the bench does the same).
    os._exit(code)
