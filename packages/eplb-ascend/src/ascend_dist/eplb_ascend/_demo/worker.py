"""One EP rank of the `eplb` demo/bench and of the multi-process tests (a process entry point).

Runs in: a child process started by `scenario.py` or the tests:
``python -m ascend_dist.eplb_ascend._demo.worker '<json config>'``. It joins a gloo group on
127.0.0.1, builds a synthetic MoE layer set (each expert its own tensors, filled with a value
derived from (layer, expert, k) so any rank can check what it holds), and runs one mode:

- ``rebalance``: a skewed load, the collective fresh-load decision, a rebalance, weights verified,
  routing tables verified in place; the vLLM-shaped transfer queue; optionally a raw-gloo baseline.
- ``failures``: a bad placement, mismatched shapes across ranks, a silent peer; the old placement
  must stay valid each time.

It prints one JSON line (the last line of stdout) with what it saw.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ascend_dist.eplb_ascend.communicator import ExpertTransferQueue
from ascend_dist.eplb_ascend.controller import EplbRankState
from ascend_dist.eplb_ascend.mover import ExpertWeightMover
from ascend_dist.eplb_ascend.placement import initial_placement, placement_diff
from ascend_dist.eplb_ascend.policy import balance_placement
from ascend_dist.eplb_ascend.state import FreshLoadGate
from ascend_dist.eplb_ascend.tables import compute_routing_table
from ascend_dist.eplb_ascend.transport import GlooTransport

__all__ = ["expert_value", "main", "run_rank"]


def expert_value(layer: int, expert: int, k: int) -> float:
    """The fill value of weight `k` of `expert` in `layer` (exact in float32)."""
    return float(layer * 10_000 + expert * 10 + k)


def build_weights(local: np.ndarray, shapes: list[list[int]], bump: int = 0) -> list[list[list[torch.Tensor]]]:
    """``weights[layer][slot][k]``: standalone tensors filled with `expert_value`."""
    return [
        [
            [
                torch.full([*shape[:-1], shape[-1] + bump], expert_value(layer, int(e), k))
                for k, shape in enumerate(shapes)
            ]
            for e in row
        ]
        for layer, row in enumerate(local)
    ]


def weights_match(state: EplbRankState) -> bool:
    """Every slot of this rank holds exactly the expert its placement says."""
    for layer, row in enumerate(state.local_experts()):
        for slot, expert in enumerate(row.tolist()):
            for k, t in enumerate(state.weights[layer][slot]):
                if not bool((t == expert_value(layer, expert, k)).all()):
                    return False
    return True


def _setup(cfg: dict[str, Any]) -> tuple[EplbRankState, GlooTransport]:
    rank, world = int(cfg["rank"]), int(cfg["world"])
    torch.set_num_threads(1)  # many ranks share few cores: intra-op thread pools would oversubscribe them
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
        timeout=timedelta(seconds=float(cfg.get("group_timeout_s", 60))),
    )  # fmt: skip
    transport = GlooTransport()
    placement = initial_placement(cfg["num_logical"], cfg["num_physical"], cfg["num_layers"])
    per_rank = cfg["num_physical"] // world
    local = placement[:, rank * per_rank : (rank + 1) * per_rank]
    weights = build_weights(local, cfg["shapes"])
    mover = ExpertWeightMover(transport, timeout_s=float(cfg.get("timeout_s", 30)))
    state = EplbRankState(placement, num_logical=cfg["num_logical"], weights=weights, mover=mover)
    return state, transport


def _skewed_global_load(cfg: dict[str, Any], rank: int) -> np.ndarray:
    rng = np.random.default_rng(1234 + rank)
    local = rng.zipf(1.3, size=(cfg["num_layers"], cfg["num_logical"])).astype(np.int64)
    local[:, 0] += 1000  # expert 0 is hot everywhere
    total = torch.from_numpy(local)
    dist.all_reduce(total)
    return total.numpy()


def _queue_round_trip(transport: GlooTransport, shapes: list[list[int]]) -> bool:
    """VLLM's add_send/add_recv/execute: send expert `rank` to the next rank, receive from the previous."""
    rank, world = transport.rank, transport.world_size
    queue = ExpertTransferQueue(transport, timeout_s=30)
    mine = [torch.full(s, expert_value(0, rank, k)) for k, s in enumerate(shapes)]
    theirs = [torch.empty(s) for s in shapes]
    prev = (rank - 1) % world
    queue.add_send(mine, (rank + 1) % world, expert_id=rank)
    queue.add_recv(theirs, prev, expert_id=prev)
    queue.execute()
    return queue.pending == 0 and all(bool((t == expert_value(0, prev, k)).all()) for k, t in enumerate(theirs))


def _raw_gloo_baseline(state: EplbRankState) -> float:
    """The same expert copies as the last plan, as plain dist.isend/irecv: the bench baseline.

    Timed like our transfer phase: from after a synchronising collective to this rank's last completion.
    """
    plan = state.last_plan
    assert plan is not None
    rank, local = state.ep_rank, plan.local_slot
    dist.barrier()
    start = time.perf_counter()
    works = []
    for tag, m in plan.sends_for(rank):
        for k, t in enumerate(state.weights[m.layer][local(m.src_slot)]):
            works.append(dist.isend(t, m.dst_rank, tag=tag * 8 + k))
    for tag, m in plan.recvs_for(rank):
        for k, t in enumerate(state.weights[m.layer][local(m.dst_slot)]):
            works.append(dist.irecv(torch.empty_like(t), m.src_rank, tag=tag * 8 + k))
    for w in works:
        w.wait()
    return time.perf_counter() - start


def run_rebalance(cfg: dict[str, Any], state: EplbRankState, transport: GlooTransport) -> dict[str, Any]:
    """The happy path: gate, rebalance, verify."""
    rank = transport.rank
    gate = FreshLoadGate()
    coordinator = type("Coordinator", (), {"cpu_group": dist.group.WORLD, "device_group": None})()
    quiet = gate.any_rank_fresh(coordinator)
    gate.note_step(is_dummy=False, is_profile=False, should_record=rank == 0)  # only rank 0 recorded load
    fresh = gate.any_rank_fresh(coordinator)
    load = _skewed_global_load(cfg, rank)
    old = state.placement.copy()
    new = balance_placement(load, cfg["num_physical"], transport.world_size)
    table, table_ptr = state.tables.table, state.tables.table.data_ptr()
    l2p_ptr = state.logical_to_physical.data_ptr()
    dist.barrier()
    stats = state.rearrange(new)
    dist.barrier()
    expected_table = compute_routing_table(state.logical_to_physical, state.replica_count, rank)
    diff = placement_diff(old, new, transport.world_size, cfg["num_logical"])
    expert_bytes = sum(int(np.prod(s)) * 4 for s in cfg["shapes"])
    received = torch.tensor([stats.bytes_received], dtype=torch.int64)
    dist.all_reduce(received)
    out: dict[str, Any] = {
        "rank": rank,
        "skip_when_quiet": not quiet,
        "fresh_anywhere": fresh,
        "weights_ok": weights_match(state),
        "table_in_place": state.tables.table is table and table.data_ptr() == table_ptr,
        "maps_in_place": state.logical_to_physical.data_ptr() == l2p_ptr,
        "table_values_ok": bool(torch.equal(state.tables.table, expected_table)),
        "placement_changed": bool((old != new).any()),
        "hot_replicas": int((new[0] == 0).sum()),
        "bytes_moved": int(received.item()),
        "bytes_minimum": diff.num_remote_fetches * expert_bytes,
        "seconds": stats.seconds,
        "queue_ok": _queue_round_trip(transport, cfg["shapes"]),
    }
    if cfg.get("rounds"):
        out["best"] = _bench_rounds(state, old, new, int(cfg["rounds"]))
    return out


def _bench_rounds(state: EplbRankState, old: np.ndarray, new: np.ndarray, rounds: int) -> dict[str, float]:
    """Best times over `rounds` rearrangements (alternating back and forth), each beside raw gloo."""
    best = {"rearrange": float("inf"), "transfer": float("inf"), "raw": float("inf")}
    targets = [old, new]
    for i in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        stats = state.rearrange(targets[i % 2])
        dist.barrier()
        best["rearrange"] = min(best["rearrange"], time.perf_counter() - start)
        best["transfer"] = min(best["transfer"], stats.transfer_seconds)
        best["raw"] = min(best["raw"], _raw_gloo_baseline(state))
    return best


def _attempt(state: EplbRankState, new: np.ndarray) -> dict[str, Any]:
    old, table = state.placement.copy(), state.tables.table.clone()
    start, error = time.perf_counter(), None
    try:
        state.rearrange(new)
    except Exception as exc:  # reported to the parent, which checks the type
        error = type(exc).__name__
        print(f"rank {state.ep_rank}: {error}: {exc}", file=sys.stderr, flush=True)
    kept = bool((state.placement == old).all()) and bool(torch.equal(state.tables.table, table))
    return {"error": error, "elapsed": time.perf_counter() - start, "kept": kept and weights_match(state)}


def run_failures(cfg: dict[str, Any], state: EplbRankState, transport: GlooTransport) -> dict[str, Any]:
    """The failure paths in order: a bad placement, mismatched shapes, a silent peer (breaks the group)."""
    rank, last = transport.rank, transport.world_size - 1
    new = np.roll(state.placement, 1, axis=1)  # every slot changes, experts cross ranks
    out: dict[str, Any] = {"rank": rank, "bad_placement": _attempt(state, np.zeros_like(new))}
    bumped = state
    if rank == last:  # same placements, but this rank's expert tensors have another shape
        weights = build_weights(state.local_experts(), cfg["shapes"], 1)
        bumped = EplbRankState(state.placement, num_logical=state.num_logical, mover=state.mover, weights=weights)
    out["mismatch"] = _attempt(bumped, new)
    if rank == last:
        time.sleep(state.mover.timeout_s * 3)  # alive but never answers
    else:
        out["silent_peer"] = _attempt(state, new)
    return out


def run_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run one rank with a config dict; returns its JSON-able result."""
    state, transport = _setup(cfg)
    try:
        runner = run_rebalance if cfg["mode"] == "rebalance" else run_failures
        return runner(cfg, state, transport)
    finally:
        if cfg["mode"] == "rebalance":  # after a timeout gloo closed the pair; exiting is the cleanup
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """Entry point: one JSON config argument, one JSON result line."""
    print(json.dumps(run_rank(json.loads((argv or sys.argv)[1]))), flush=True)


if __name__ == "__main__":
    main()
