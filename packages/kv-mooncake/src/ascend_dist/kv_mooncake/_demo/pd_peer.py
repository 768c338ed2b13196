"""P instances in their own process, driven by JSON lines on stdin/stdout (never pickle).

Runs in: the child process started by the ``pd`` scenario and the tests:
``python -m ascend_dist.kv_mooncake._demo.pd_peer`` prints ``{"ready": true}``, then answers, one JSON
line each:

* ``{"cmd": "create", "name", "config": {...}, "model": {...}}`` -> ``{"ok": true}`` (a producer
  `SyntheticInstance`; several may live in one process and share its Mooncake engine)
* ``{"cmd": "prefill", "name", "rid", "prompt_len", "seed", "end"?}`` -> ``{"params": {...}}`` (``end``:
  ``"length"`` by default, ``"stopped"`` or ``"aborted"`` for a request that lends nothing: ``{}``)
* ``{"cmd": "prefill_many", "name", "rids", "prompt_len", "seed"}`` -> ``{"params": [...]}``
* ``{"cmd": "poll", "name"}`` -> ``{"freed": [...], "tracked": n, "blocks_lent": n, "expired": n,
  "late_dones": n}``
* ``{"cmd": "drop", "name"}`` -> ``{"ok": true}`` (shuts that instance's workers down)
* ``{"cmd": "quit"}`` -> shuts every instance down and exits.

It exits by itself when stdin closes, so it never outlives its parent.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from ascend_dist.kv_mooncake._demo.peer_serve import serve
from ascend_dist.kv_mooncake._demo.synthetic import Model, SyntheticInstance
from ascend_dist.kv_mooncake.pull.config import PullConfig

__all__ = ["main"]


def _poll(inst: SyntheticInstance) -> dict[str, Any]:
    freed, _, _ = inst.poll()
    for rid in freed:
        inst.release(rid)
    lent = sum(len(ids) for per in inst.blocks.values() for ids in per)
    trackers = sum(len(r.worker.tracker) for r in inst.ranks)
    expired = sum(r.worker.tracker.expired_count for r in inst.ranks)
    return {
        "freed": sorted(freed),
        "tracked": trackers + inst.scheduler.tracked,
        "blocks_lent": lent,
        "expired": expired,
        "late_dones": sum(r.worker.tracker.late_dones for r in inst.ranks),
    }


def _create(msg: dict[str, Any]) -> SyntheticInstance:
    extra = msg["config"]
    config = PullConfig.from_kv_transfer_config(
        engine_id=extra["engine_id"],
        kv_role="kv_producer",
        kv_port=extra["kv_port"],
        extra=extra,
        model=extra.get("model", "synthetic"),
        dtype="int16",
    )
    return SyntheticInstance(config, Model(**msg["model"]))


_COMMANDS: dict[str, Callable[[SyntheticInstance, dict[str, Any]], dict[str, Any]]] = {
    "prefill": lambda inst, m: {
        "params": inst.prefill(m["rid"], int(m["prompt_len"]), int(m["seed"]), end=str(m.get("end", "length")))
    },
    "prefill_many": lambda inst, m: {
        "params": [inst.prefill(rid, int(m["prompt_len"]), int(m["seed"])) for rid in m["rids"]]
    },
    "poll": lambda inst, m: _poll(inst),
}


def main() -> int:
    """Serve commands until ``quit`` or end of input."""
    return serve(_create, _COMMANDS)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Workers are shut down and unregistered; skip the native engine's slow teardown at exit.
    os._exit(code)
