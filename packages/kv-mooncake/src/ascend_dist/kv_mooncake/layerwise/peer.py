"""Layer-wise P ranks in their own process, driven by JSON lines on stdin/stdout (never pickle).

Runs in: the child processes started by the ``pd-layerwise`` scenario and the tests:
``python -m ascend_dist.kv_mooncake.layerwise.peer`` prints ``{"ready": true}``, then answers, one
JSON line each:

* ``{"cmd": "create", "name", "config": {...}, "model": {...}, "tp_ranks": [..], "gloo": null |
  {"init_method", "rank", "world_size", "timeout_s"}}`` -> ``{"ok": true}``. With ``gloo`` the
  process joins a gloo group of all P ranks and builds the all-to-all sub-groups of spec §7.5.1
  (the ``pd_head_ratio`` consecutive ranks feeding one D rank).
* ``{"cmd": "prefill", "name", "params", "prompt_len", "seed", "compute_s", "chunks", "kv_in_forward"}``
  -> ``{"start": monotonic, "elapsed": s}`` (the layer-by-layer forward; pushes overlap it).
* ``{"cmd": "raw_push", "name", "params", "prompt_len"}`` -> ``{"elapsed": s}`` (the benchmark's
  raw-engine baseline: the same writes, one ``batch_transfer_sync_write`` per layer, no compute).
* ``{"cmd": "compute_only", "name", "compute_s"}`` -> ``{"elapsed": s}`` (the forward's simulated
  compute alone, every layer, no push: the bench's measured total compute).
* ``{"cmd": "idle", "name"}`` -> ``{"ok": true}`` once every layer's push finished.
* ``{"cmd": "drop", "name"}``; ``{"cmd": "quit"}`` shuts everything down and exits.

It exits by itself when stdin closes, so it never outlives its parent.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import selectors
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from ascend_dist.common.errors import ProtocolError
from ascend_dist.kv_mooncake.layerwise.config import LayerwiseConfig
from ascend_dist.kv_mooncake.layerwise.reshard import AllToAll, GlooAllToAll
from ascend_dist.kv_mooncake.layerwise.synthetic import LwInstance
from ascend_dist.kv_mooncake.peer_process import PeerProcess
from ascend_dist.kv_mooncake.synthetic import Model

__all__ = ["LwPeerProcess", "main"]


class LwPeerProcess(PeerProcess):
    """A ``python -m ascend_dist.kv_mooncake.layerwise.peer`` child (same JSON-lines driver as the pull's)."""

    def __init__(self, *, ready_timeout_s: float = 60.0) -> None:
        """Start the child and wait until it reports ready."""
        env = {**os.environ, "GLOG_minloglevel": "2"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ascend_dist.kv_mooncake.layerwise.peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
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


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _gloo(spec: dict[str, Any] | None, config: LayerwiseConfig, heads: int, mla: bool) -> AllToAll | None:
    if not spec:
        return None
    import torch.distributed as dist

    rank, world = int(spec["rank"]), int(spec["world_size"])
    dist.init_process_group(
        "gloo",
        init_method=str(spec["init_method"]),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=float(spec.get("timeout_s", 30.0))),
    )
    ratio = config.parallel_infos(heads, mla)[0].pd_head_ratio
    mine = None
    for first in range(0, world, ratio):  # every process creates every sub-group, in the same order
        group = dist.new_group(list(range(first, first + ratio)))
        if first <= rank < first + ratio:
            mine = group
    return GlooAllToAll(mine)


def _create(msg: dict[str, Any]) -> LwInstance:
    extra = msg["config"]
    config = LayerwiseConfig.from_kv_transfer_config(
        engine_id=extra["engine_id"],
        kv_role="kv_producer",
        kv_port=extra["kv_port"],
        extra=extra,
        model=extra.get("model", "synthetic"),
        dtype="int16",
    )
    model = Model(**msg["model"])
    a2a = _gloo(msg.get("gloo"), config, model.heads, model.mla)
    return LwInstance(config, model, tp_ranks=list(msg.get("tp_ranks") or []), all_to_all=a2a)


def _prefill(inst: LwInstance, msg: dict[str, Any]) -> dict[str, Any]:
    start, elapsed = inst.prefill(
        msg["params"],
        int(msg["prompt_len"]),
        int(msg["seed"]),
        compute_s=float(msg.get("compute_s", 0.0)),
        chunks=int(msg.get("chunks", 1)),
        kv_in_forward=bool(msg.get("kv_in_forward", True)),
    )
    return {"start": start, "elapsed": elapsed}


def _idle(inst: LwInstance, msg: dict[str, Any]) -> dict[str, Any]:
    inst.wait_idle()
    return {"ok": True, "blocks_lent": sum(len(i) for per in inst.blocks.values() for i in per)}


_COMMANDS: dict[str, Callable[[LwInstance, dict[str, Any]], dict[str, Any]]] = {
    "prefill": _prefill,
    "idle": _idle,
    "compute_only": lambda inst, m: {"elapsed": inst.compute_only(float(m["compute_s"]))},
    "raw_push": lambda inst, m: {"elapsed": inst.raw_push(m["params"], int(m["prompt_len"]))},
}


def _serve(instances: dict[str, LwInstance], msg: dict[str, Any]) -> dict[str, Any]:
    cmd = msg.get("cmd")
    if cmd == "create":
        instances[msg["name"]] = _create(msg)
        return {"ok": True}
    inst = instances.get(msg.get("name", ""))
    if inst is None:
        return {"error": f"unknown instance {msg.get('name')!r} for cmd {cmd!r}"}
    if cmd == "drop":
        instances.pop(msg["name"]).shutdown()
        return {"ok": True}
    handler = _COMMANDS.get(str(cmd))
    return handler(inst, msg) if handler else {"error": f"unknown cmd {cmd!r}"}


def main() -> int:
    """Serve commands until ``quit`` or end of input."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    instances: dict[str, LwInstance] = {}
    _reply({"ready": True})
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("cmd") == "quit":
                break
            try:
                _reply(_serve(instances, msg))
            except Exception as exc:  # a bad command is reported, the process keeps serving
                _reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for inst in instances.values():
            inst.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Workers are shut down and unregistered; skip the native engine's and gloo's slow teardown.
    os._exit(code)
