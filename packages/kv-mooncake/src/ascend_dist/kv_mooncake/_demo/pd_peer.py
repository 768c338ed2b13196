"""P instances in their own process, driven by JSON lines on stdin/stdout (never pickle).

Runs in: the child process started by the ``pd`` scenario and the tests:
``python -m ascend_dist.kv_mooncake._demo.pd_peer`` prints ``{"ready": true}``, then answers, one JSON
line each:

* ``{"cmd": "create", "name", "config": {...}, "model": {...}, "role"?, "ranks"?}`` -> ``{"ok": true}``
  (a `SyntheticInstance`, a producer unless ``role`` is ``"consumer"``, with only the ``ranks``
  listed when given; several may live in one process and share its Mooncake engine)
* ``{"cmd": "prefill", "name", "rid", "prompt_len", "seed", "end"?, "preempt"?}`` -> ``{"params": {...}}``
  (``end``: ``"length"`` by default, ``"stopped"`` or ``"aborted"`` for a request that lends
  nothing: ``{}``; ``preempt``: preempted after its first step and scheduled again)
* ``{"cmd": "prefill_many", "name", "rids", "prompt_len", "seed", "seeds"?}`` -> ``{"params": [...]}``
  (``seeds``: one per request instead of one for all)
* ``{"cmd": "addresses", "name"}`` -> ``{"addresses": [[host, port], ...]}`` (each local P rank's side
  channel, vLLM's handshake metadata); ``{"cmd": "set_addresses", "name", "addresses"}`` ->
  ``{"rank_hosts": [...]}`` (hands every worker's address to P's scheduler, as vLLM does)
* ``{"cmd": "poll", "name"}`` -> ``{"freed": [...], "tracked": n, "blocks_lent": n, "expired": n,
  "late_dones": n, "refused_readers": n}``
* ``{"cmd": "engine", "name"}`` -> ``{"session": "host:rpc_port", "transport_ports": [...]}`` (the
  instance's Mooncake engine, as its metadata names it)
* D instances (``role: "consumer"``, e.g. a D in another network namespace):

  * ``{"cmd": "decode", "name", "rid", "prompt_len", "params", "computed"?}`` -> ``{"count": n,
    "blocks": [[...]]}`` (queue the pull; D's block ids per group)
  * ``{"cmd": "recv_poll", "name"}`` -> ``{"recv": [...], "errors": [...]}`` (requests every rank
    finished receiving since the last poll, load-error block ids)
  * ``{"cmd": "verify", "name", "rid", "seed", "computed"?}`` -> ``{"bytes": n}`` (every pulled byte
    against the pattern; an error reply naming the first differing layer otherwise)
  * ``{"cmd": "digest", "name", "rid"}`` -> ``{"sha256": "..."}`` (of the request's blocks on every
    rank: shows whether anything wrote into them since the last digest)
  * ``{"cmd": "finish", "name", "rid"}`` -> ``{"ok": true}`` (D frees the request's blocks)
  * ``{"cmd": "d_state", "name"}`` -> what D still holds (``pulling``, ``quarantined``, ``tracked``,
    ``blocks_held``), its engine's ``engine_pieces`` (reads not yet returned, hung ones too) and the
    process's ``threads`` (native ones too) and ``fds``

* ``{"cmd": "drop", "name"}`` -> ``{"ok": true}`` (shuts that instance's workers down)
* ``{"cmd": "quit"}`` -> shuts every instance down and exits.

It exits by itself when stdin closes, so it never outlives its parent.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from ascend_dist.common.auth_cost import AUTH_COST
from ascend_dist.kv_mooncake._demo.peer_serve import serve
from ascend_dist.kv_mooncake._demo.synthetic import Model, SyntheticInstance, block_view
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, get_engine
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
        "refused_readers": sum(r.worker.tracker.refused_readers for r in inst.ranks),
        "auth_cost": list(AUTH_COST.snapshot()),  # P's signing and MACs so far (ns, operations)
    }


def _engine(inst: SyntheticInstance) -> dict[str, Any]:
    engine = inst.engine or get_engine(inst.config.host, inst.config.protocol)  # the workers' engine
    return {"session": engine.session, "transport_ports": list(engine.transport_ports)}


def _d_state(inst: SyntheticInstance) -> dict[str, Any]:
    receivers = [r.worker.receiver for r in inst.ranks if r.worker.receiver is not None]
    engine = inst.engine or get_engine(inst.config.host, inst.config.protocol)  # the workers' engine
    return {
        "engine_pieces": engine.pieces_in_flight if isinstance(engine, MooncakeEngine) else 0,
        "pulling": sum(r.in_flight for r in receivers),
        "quarantined": sum(r.quarantined for r in receivers),
        "tracked": inst.scheduler.tracked,
        "blocks_held": sum(len(ids) for per in inst.blocks.values() for ids in per),
        "threads": len(os.listdir("/proc/self/task")),  # native (Mooncake) threads too
        "fds": len(os.listdir("/proc/self/fd")),
    }


def _digest(inst: SyntheticInstance, rid: str) -> dict[str, Any]:
    h = hashlib.sha256()
    for r in inst.ranks:
        for i in r.layers:
            ids = torch.tensor(inst.blocks[rid][i % inst.model.groups])
            for t in r.caches[inst.model.layer_name(i)]:
                h.update(block_view(t, inst.model.num_blocks)[ids].contiguous().numpy().tobytes())
    return {"sha256": h.hexdigest()}


def _recv_poll(inst: SyntheticInstance) -> dict[str, Any]:
    _, recv, errors = inst.poll()
    return {"recv": sorted(recv), "errors": sorted(errors)}


def _create(msg: dict[str, Any]) -> SyntheticInstance:
    extra = msg["config"]
    role = str(msg.get("role", "producer"))
    if role not in ("producer", "consumer"):
        raise ValueError(f"role={role!r} is invalid: expected 'producer' or 'consumer'")
    config = PullConfig.from_kv_transfer_config(
        engine_id=extra["engine_id"],
        kv_role=f"kv_{role}",
        kv_port=extra["kv_port"],
        extra=extra,
        model=extra.get("model", "synthetic"),
        dtype="int16",
    )
    return SyntheticInstance(config, Model(**msg["model"]), local_ranks=tuple(int(r) for r in msg.get("ranks", ())))


def _set_addresses(inst: SyntheticInstance, m: dict[str, Any]) -> dict[str, Any]:
    inst.scheduler.set_rank_addresses((str(host), int(port)) for host, port in m["addresses"])
    return {"rank_hosts": inst.scheduler.rank_hosts}


_COMMANDS: dict[str, Callable[[SyntheticInstance, dict[str, Any]], dict[str, Any]]] = {
    "prefill": lambda inst, m: {
        "params": inst.prefill(
            m["rid"],
            int(m["prompt_len"]),
            int(m["seed"]),
            end=str(m.get("end", "length")),
            preempt=bool(m.get("preempt", False)),
        )
    },
    "prefill_many": lambda inst, m: {
        "params": [
            inst.prefill(rid, int(m["prompt_len"]), int(seed))
            for rid, seed in zip(m["rids"], m.get("seeds") or [m["seed"]] * len(m["rids"]), strict=True)
        ]
    },
    "poll": lambda inst, m: _poll(inst),
    "engine": lambda inst, m: _engine(inst),
    "addresses": lambda inst, m: {"addresses": [r.worker.rank_address for r in inst.ranks]},
    "set_addresses": _set_addresses,
    "decode": lambda inst, m: {
        "count": inst.decode(m["rid"], int(m["prompt_len"]), dict(m["params"]), int(m.get("computed", 0))),
        "blocks": inst.blocks[m["rid"]],
    },
    "recv_poll": lambda inst, m: _recv_poll(inst),
    "verify": lambda inst, m: {"bytes": inst.verify(m["rid"], int(m["seed"]), int(m.get("computed", 0)))},
    "digest": lambda inst, m: _digest(inst, m["rid"]),
    "finish": lambda inst, m: inst.finish_decode(m["rid"]) or {"ok": True},
    "d_state": lambda inst, m: _d_state(inst),
}


def main() -> int:
    """Serve commands until ``quit`` or end of input."""
    return serve(_create, _COMMANDS)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Workers are shut down and unregistered; skip the native engine's slow teardown at exit.
    os._exit(code)
