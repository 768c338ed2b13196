"""Layer-wise P ranks in their own process, driven by JSON lines on stdin/stdout (never pickle).

Runs in: the child processes started by the ``pd-layerwise`` scenario and the tests:
``python -m ascend_dist.kv_mooncake._demo.push_peer`` prints ``{"ready": true}``, then answers, one
JSON line each:

* ``{"cmd": "create", "name", "config": {...}, "model": {...}, "tp_ranks": [..], "gloo": null |
  {"init_method", "rank", "world_size", "timeout_s"}}`` -> ``{"ok": true}``. With ``gloo`` the
  process joins a gloo group of all P ranks and builds the all-to-all sub-groups
  (the ``pd_head_ratio`` consecutive ranks feeding one D rank).
* ``{"cmd": "prefill", "name", "params", "prompt_len", "seed", "compute_s", "chunks", "kv_in_forward", "pause_s"}``
  -> ``{"start": monotonic, "elapsed": s}`` (the layer-by-layer forward; pushes overlap it).
* ``{"cmd": "raw_push", "name", "params", "prompt_len"}`` -> ``{"elapsed": s}`` (the benchmark's
  raw-engine baseline: the same writes, one ``batch_transfer_sync_write`` per layer, no compute).
* ``{"cmd": "compute_only", "name", "compute_s"}`` -> ``{"elapsed": s}`` (the forward's simulated
  compute alone, every layer, no push: the bench's measured total compute).
* ``{"cmd": "prefill_many", "name", "items": [{"params", "prompt_len", "seed", "compute_s", "chunks",
  "abort_after", "pause_s"}, ...]}`` -> ``{"done": n}`` (the prefills one after the other, in one
  round trip; ``abort_after`` > 0 ends the request on P after that many chunks, ``pause_s`` stalls
  each step after its first layer).
* ``{"cmd": "idle", "name"}`` -> ``{"ok": true}`` once every layer's push finished.
* ``{"cmd": "held", "name"}`` -> what the instance holds (`LwInstance.held`) once idle, plus the
  process's ``threads`` (native ones too), open ``fds`` and engine ``regions``.
* ``{"cmd": "engine", "name"}`` -> ``{"session": "host:rpc_port", "transport_ports": [...]}`` (the
  instance's Mooncake engine).
* D instances (``"role": "consumer"`` in ``create``; D announces to a metaserver kept in the child):

  * ``{"cmd": "announce", "name", "rid", "prompt_len"}`` -> ``{"params": {...}}`` (what D announced:
    the proxy hands it to every P rank)
  * ``{"cmd": "wait_recv", "name", "rids", "timeout_s"}`` -> ``{"errors": [...]}`` (load-error block ids)
  * ``{"cmd": "verify", "name", "rid", "seed"}`` -> ``{"bytes": n}`` (every pushed byte against P's
    pattern; an error reply naming the first differing layer otherwise)
  * ``{"cmd": "blocks", "name", "rid"}`` -> ``{"blocks": [[...]]}`` (D's block ids per group)
  * ``{"cmd": "reason", "name", "rid"}`` -> ``{"reason": "..."}`` (why the request failed on D's
    first rank, P's reason when P reported it; empty when it did not fail)

* ``{"cmd": "drop", "name"}``; ``{"cmd": "quit"}`` shuts everything down and exits.

It exits by itself when stdin closes, so it never outlives its parent.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from typing import Any

from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess
from ascend_dist.kv_mooncake._demo.peer_serve import serve
from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver, LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.plan import a2a_groups
from ascend_dist.kv_mooncake.push.reshard import AllToAll, GlooAllToAll

__all__ = ["LwPeerProcess", "main"]


class LwPeerProcess(PeerProcess):
    """A ``python -m ascend_dist.kv_mooncake._demo.push_peer`` child (same JSON-lines driver as the pull's)."""

    def __init__(self, *, ready_timeout_s: float = 60.0, rpc_ports: tuple[int, int] | None = None) -> None:
        """Start the child and wait until it reports ready (``rpc_ports``: see `PeerProcess`)."""
        super().__init__(
            module="ascend_dist.kv_mooncake._demo.push_peer", ready_timeout_s=ready_timeout_s, rpc_ports=rpc_ports
        )


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
    for members in a2a_groups(world, heads, ratio):  # every process creates every sub-group, in the same order
        group = dist.new_group(members)
        if rank in members:
            mine = group
    return GlooAllToAll(mine)


def _create(msg: dict[str, Any]) -> LwInstance:
    extra = msg["config"]
    consumer = msg.get("role") == "consumer"
    config = LayerwiseConfig.from_kv_transfer_config(
        engine_id=extra["engine_id"],
        kv_role="kv_consumer" if consumer else "kv_producer",
        kv_port=extra["kv_port"],
        extra=extra,
        model=extra.get("model", "synthetic"),
        dtype="int16",
    )
    model = Model(**msg["model"])
    if consumer:
        return LwInstance(config, model, metaserver=CollectingMetaserver())
    a2a = _gloo(msg.get("gloo"), config, model.heads, model.mla)
    return LwInstance(config, model, tp_ranks=list(msg.get("tp_ranks") or []), all_to_all=a2a)


def _announce(inst: LwInstance, msg: dict[str, Any]) -> dict[str, Any]:
    rid = str(msg["rid"])
    inst.announce(rid, int(msg["prompt_len"]))
    if not isinstance(inst.metaserver, CollectingMetaserver):
        return {"error": "announce: not a D instance of this child"}
    return {"params": inst.metaserver.take(rid)}


def _engine(inst: LwInstance, msg: dict[str, Any]) -> dict[str, Any]:
    assert inst.engine is not None
    return {"session": inst.engine.session, "transport_ports": list(inst.engine.transport_ports)}


def _prefill(inst: LwInstance, msg: dict[str, Any]) -> dict[str, Any]:
    start, elapsed = inst.prefill(
        msg["params"],
        int(msg["prompt_len"]),
        int(msg["seed"]),
        compute_s=float(msg.get("compute_s", 0.0)),
        chunks=int(msg.get("chunks", 1)),
        kv_in_forward=bool(msg.get("kv_in_forward", True)),
        pause_s=float(msg.get("pause_s", 0.0)),
    )
    return {"start": start, "elapsed": elapsed}


def _prefill_many(inst: LwInstance, msg: dict[str, Any]) -> dict[str, Any]:
    for item in msg["items"]:
        inst.prefill(
            item["params"],
            int(item["prompt_len"]),
            int(item["seed"]),
            compute_s=float(item.get("compute_s", 0.0)),
            chunks=int(item.get("chunks", 1)),
            abort_after=int(item.get("abort_after", 0)),
            pause_s=float(item.get("pause_s", 0.0)),
        )
    return {"done": len(msg["items"])}


def _held(inst: LwInstance, msg: dict[str, Any]) -> dict[str, Any]:
    inst.wait_idle()
    assert inst.engine is not None
    regions = len(inst.engine.registered) if isinstance(inst.engine, MooncakeEngine) else -1
    proc = {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")), "regions": regions}
    return {**inst.held(), **proc}


def _idle(inst: LwInstance, msg: dict[str, Any]) -> dict[str, Any]:
    inst.wait_idle()
    return {"ok": True, "blocks_lent": sum(len(i) for per in inst.blocks.values() for i in per)}


_COMMANDS: dict[str, Callable[[LwInstance, dict[str, Any]], dict[str, Any]]] = {
    "prefill": _prefill,
    "idle": _idle,
    "prefill_many": _prefill_many,
    "held": _held,
    "compute_only": lambda inst, m: {"elapsed": inst.compute_only(float(m["compute_s"]))},
    "raw_push": lambda inst, m: {"elapsed": inst.raw_push(m["params"], int(m["prompt_len"]))},
    "engine": _engine,
    "announce": _announce,
    "wait_recv": lambda inst, m: {
        "errors": sorted(inst.wait_recv({str(r) for r in m["rids"]}, float(m.get("timeout_s", 20.0))))
    },
    "verify": lambda inst, m: {"bytes": inst.verify(str(m["rid"]), int(m["seed"]))},
    "blocks": lambda inst, m: {"blocks": inst.blocks[str(m["rid"])]},
    "reason": lambda inst, m: {"reason": inst.ranks[0].worker.failure_reasons.get(str(m["rid"]), "")},
}


def main() -> int:
    """Serve commands until ``quit`` or end of input."""
    return serve(_create, _COMMANDS)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # Workers are shut down and unregistered; skip the native engine's and gloo's slow teardown.
    os._exit(code)
