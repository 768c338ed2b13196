"""Child of ``test_pull_affinity.py``: a P and a D pinned like vLLM's CPU workers, one real pull, JSON out.

    python affinity_child.py KV_PORT

Its main thread is bound to one CPU first, as vLLM's CPU worker binds its forward thread before the
connector registers, then it builds P and D (`SyntheticInstance`: the real `PullWorker` over
Mooncake's TCP transport and the ZMQ side channel on 127.0.0.1), pulls one request and checks its
bytes. It prints one JSON object: the main thread's CPUs before and after, the CPUs of every thread
started meanwhile (native ones included) by name, the bytes checked and D's load errors.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("GLOG_minloglevel", "2")

from ascend_dist.kv_mooncake._demo.synthetic import Model, SyntheticInstance
from ascend_dist.kv_mooncake.pull.config import PullConfig


def _threads() -> dict[str, tuple[str, list[int]]]:
    """tid -> (name, allowed CPUs) of every thread of this process."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[task.name] = (name, sorted(os.sched_getaffinity(int(task.name))))
        except (OSError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return out


def main() -> None:
    kv_port = int(sys.argv[1])
    allowed = sorted(os.sched_getaffinity(0))
    forward = allowed[0]
    os.sched_setaffinity(0, {forward})  # vLLM's CPU worker: the forward thread on its OpenMP core
    before = _threads()
    extra = {
        "engine_id": "P-aff",
        "kv_port": kv_port,
        "prefill": {"tp_size": 1},
        "decode": {"tp_size": 1},
        "rpc_timeout_s": 2.0,
        "lease_s": 30.0,
    }
    model = Model(layers=2, heads=2, head_dim=16, block_size=16, num_blocks=16)
    configs = {
        role: PullConfig.from_kv_transfer_config(
            engine_id=engine_id, kv_role=role, kv_port=kv_port, extra=extra, model="synthetic", dtype="int16"
        )
        for role, engine_id in (("kv_producer", "P-aff"), ("kv_consumer", "D-aff"))
    }
    p = SyntheticInstance(configs["kv_producer"], model)
    d = SyntheticInstance(configs["kv_consumer"], model)
    try:
        params = p.prefill("r0", 40, seed=7)
        d.decode("r0", 40, params)
        errors = d.wait_recv({"r0"}, 20.0)
        checked = d.verify("r0", seed=7) if not errors else 0
        after = _threads()
        started = sorted(after[tid] for tid in after.keys() - before.keys())
        print(
            json.dumps(
                {
                    "forward": forward,
                    "main_after": sorted(os.sched_getaffinity(0)),
                    "allowed": allowed,
                    "started": started,
                    "checked": checked,
                    "errors": sorted(errors),
                }
            )
        )
    finally:
        d.shutdown()
        p.shutdown()


if __name__ == "__main__":
    main()
