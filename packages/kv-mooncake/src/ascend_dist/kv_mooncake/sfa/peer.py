"""An SFA P instance in its own process, driven by JSON lines on stdin/stdout (never pickle).

Runs in: the child process of the ``pd-sfa`` scenario and the tests:
``python -m ascend_dist.kv_mooncake.sfa.peer`` prints ``{"ready": true}``, then answers, one JSON
line each:

* ``{"cmd": "create", "name", "config": {...}, "model": {...}}`` -> ``{"ok": true}`` (several
  named P instances may share the process and its Mooncake engine)
* ``{"cmd": "prefill", "name", "items": [{"rid", "prompt_len", "seed", "params", "chunk"}]}`` ->
  ``{"steps": [...]}`` (each prefill dispatches its layers and frees its blocks at once)
* ``{"cmd": "prefill_batch", "name", "items": [...]}`` -> ``{"steps": [n]}`` (all in the same steps)
* ``{"cmd": "drain", "name"}`` -> ``{"failed": {ext id: reason}, "sent": n}`` once every gate is open
* ``{"cmd": "drop", "name"}`` -> ``{"ok": true}`` (shuts that instance down)
* ``{"cmd": "quit"}`` -> shuts every instance down and exits.

It exits by itself when stdin closes, so it never outlives its parent.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from ascend_dist.kv_mooncake.config import Role
from ascend_dist.kv_mooncake.engine import get_engine
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.synthetic import Job, SfaModel, SfaPInstance

__all__ = ["main", "producer_config"]


def producer_config(extra: dict[str, Any]) -> SfaConfig:
    """P's config from the test/scenario settings (``engine_id``, ``kv_port`` inside ``extra``)."""
    return SfaConfig.from_kv_transfer_config(
        engine_id=extra["engine_id"],
        kv_role=Role.PRODUCER.value,
        kv_port=extra["kv_port"],
        extra=extra,
        model=str(extra.get("model", "synthetic-sfa")),
        dtype="int16",
    )


def _model(raw: dict[str, Any]) -> SfaModel:
    fields = dict(raw)
    for key in ("main_dims", "indexer_dims"):
        if key in fields:
            fields[key] = tuple(fields[key])
    return SfaModel(**fields)


def _job(it: dict[str, Any]) -> Job:
    return Job(str(it["rid"]), int(it["prompt_len"]), int(it["seed"]), dict(it["params"]), int(it.get("chunk", 0)))


def _prefill(inst: SfaPInstance, msg: dict[str, Any]) -> dict[str, Any]:
    """One request after the other, each in its own steps."""
    return {"steps": [inst.prefill_batch([_job(it)], fill=bool(it.get("fill", True))) for it in msg["items"]]}


def _prefill_batch(inst: SfaPInstance, msg: dict[str, Any]) -> dict[str, Any]:
    """All requests in the same steps."""
    fill = bool(msg["items"][0].get("fill", True)) if msg["items"] else True
    return {"steps": [inst.prefill_batch([_job(it) for it in msg["items"]], fill=fill)]}


def _drain(inst: SfaPInstance, msg: dict[str, Any]) -> dict[str, Any]:
    inst.drain()
    return {"failed": inst.failed(), "sent": sum(w.dispatcher.sent for w in inst.workers)}


_COMMANDS: dict[str, Callable[[SfaPInstance, dict[str, Any]], dict[str, Any]]] = {
    "prefill": _prefill,
    "prefill_batch": _prefill_batch,
    "drain": _drain,
}


def _serve(state: dict[str, SfaPInstance], msg: dict[str, Any]) -> dict[str, Any]:
    cmd = msg.get("cmd")
    if cmd == "create":
        config = producer_config(msg["config"])
        engine = get_engine(config.host, config.protocol)
        state[str(msg["name"])] = SfaPInstance(config, _model(msg["model"]), engine)
        return {"ok": True}
    inst = state.get(str(msg.get("name")))
    if inst is None:
        return {"error": f"no instance {msg.get('name')!r} for cmd {cmd!r}"}
    if cmd == "drop":
        state.pop(str(msg["name"])).shutdown()
        return {"ok": True}
    handler = _COMMANDS.get(str(cmd))
    if handler is not None:
        return handler(inst, msg)
    return {"error": f"unknown cmd {cmd!r}"}


def main() -> int:
    """Serve commands until ``quit`` or end of input."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    state: dict[str, SfaPInstance] = {}
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("cmd") == "quit":
                break
            try:
                reply = _serve(state, msg)
            except Exception as exc:  # a bad command is reported, the process keeps serving
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        for inst in state.values():
            inst.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # workers are shut down; skip the native engine's slow teardown
