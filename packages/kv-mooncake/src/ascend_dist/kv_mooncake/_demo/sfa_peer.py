"""An SFA P instance in its own process, driven by JSON lines on stdin/stdout (never pickle).

Runs in: the child process of the ``pd-sfa`` scenario and the tests:
``python -m ascend_dist.kv_mooncake._demo.sfa_peer`` prints ``{"ready": true}``, then answers, one JSON
line each:

* ``{"cmd": "create", "name", "config": {...}, "model": {...}}`` -> ``{"ok": true}`` (several
  named P instances may share the process and its Mooncake engine)
* ``{"cmd": "prefill", "name", "items": [{"rid", "prompt_len", "seed", "params", "chunk"}]}`` ->
  ``{"steps": [...]}`` (each prefill dispatches its layers and frees its blocks at once)
* ``{"cmd": "prefill_batch", "name", "items": [...]}`` -> ``{"steps": [n]}`` (all in the same steps)
* ``{"cmd": "drain", "name", "take"}`` -> ``{"failed": {ext id: reason}, "sent": n}`` once every gate is
  open (``"take": false``: P's failures are left where they are, as vLLM's connector leaves them: ``{}``)
* ``{"cmd": "held", "name"}`` -> what the instance holds (`SfaPInstance.held`), plus the process's
  ``threads``, open ``fds`` and engine ``regions``
* ``{"cmd": "engine", "name"}`` -> ``{"session": "host:rpc_port", "transport_ports": [...]}`` (the
  process's Mooncake engine, which the instance's `Hello` names)
* ``{"cmd": "drop", "name"}`` -> ``{"ok": true}`` (shuts that instance down)
* ``{"cmd": "quit"}`` -> shuts every instance down and exits.

It exits by itself when stdin closes, so it never outlives its parent.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ascend_dist.kv_mooncake._demo.peer_serve import serve
from ascend_dist.kv_mooncake._demo.sfa_synthetic import Job, SfaModel, SfaPInstance
from ascend_dist.kv_mooncake.core.engine import get_engine
from ascend_dist.kv_mooncake.pull.config import Role
from ascend_dist.kv_mooncake.sfa.config import SfaConfig

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
    failed = inst.failed() if msg.get("take", True) else {}
    return {"failed": failed, "sent": sum(w.dispatcher.sent for w in inst.workers)}


def _held(inst: SfaPInstance, msg: dict[str, Any]) -> dict[str, Any]:
    engine = get_engine(inst.config.host, inst.config.protocol)
    fds = len(os.listdir("/proc/self/fd"))
    return {**inst.held(), "threads": threading.active_count(), "fds": fds, "regions": len(engine.registered)}


def _engine(inst: SfaPInstance, msg: dict[str, Any]) -> dict[str, Any]:
    engine = get_engine(inst.config.host, inst.config.protocol)
    return {"session": engine.session, "transport_ports": list(engine.transport_ports)}


_COMMANDS: dict[str, Callable[[SfaPInstance, dict[str, Any]], dict[str, Any]]] = {
    "prefill": _prefill,
    "prefill_batch": _prefill_batch,
    "drain": _drain,
    "held": _held,
    "engine": _engine,
}


def _create(msg: dict[str, Any]) -> SfaPInstance:
    config = producer_config(msg["config"])
    return SfaPInstance(config, _model(msg["model"]), get_engine(config.host, config.protocol))


def main() -> int:
    """Serve commands until ``quit`` or end of input."""
    return serve(_create, _COMMANDS)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # workers are shut down; skip the native engine's slow teardown
