"""Bounded soak of each offload connector inside vLLM 0.33.0's running ``Scheduler`` (nox session vllm).

Per connector (native, simple, recompute): a few thousand requests (prompts drawn from a few shared
prefixes plus random suffixes, random decode lengths) through vLLM's real ``Scheduler`` with a
device pool small enough that vLLM preempts, random aborts between steps, and copies failing at
random in both directions (`FaultyRuntime`, our fake of the `DeviceRuntime` Protocol, on every
worker of a two-worker world). Every load is checked byte for byte against what the stand-in model
wrote (its destination blocks are filled with a sentinel first); afterwards every request finished,
every device block is back in the pool, the connector has nothing pending, and no thread is left.
Each case is bounded in wall time (``ASCEND_DIST_SOAK_S``, default 40 s of traffic, then a drain of a
few seconds; about 1,500-2,000 requests per connector on the shared 2-core machine).
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.soak, pytest.mark.timeout(180)]
pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from offload_vllm_loop import NATIVE, RECOMPUTE, SIMPLE, Loop, make_config, write_model_dir  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dist.common.device import CopyDirection  # noqa: E402
from ascend_dist.kv_offload.vllm_preempt_scheduler import PreemptSavingScheduler  # noqa: E402

TRAFFIC_S = float(os.environ.get("ASCEND_DIST_SOAK_S", "40"))  # per connector; then a drain of seconds
MAX_REQUESTS = 3000
FAULT_RATE = 0.03
NUM_BLOCKS = 32  # 31 usable blocks of 16 tokens: eight requests of up to 168 tokens outgrow them (vLLM preempts)

CASES: dict[str, dict[str, Any]] = {
    "native": {
        "connector": "AscendOffloadingConnector", "module": NATIVE, "prefix_caching": True,
        "extra": {"spec_name": "NPUOffloadingSpec", "spec_module_path": NATIVE, "cpu_bytes_to_use": 1 << 20},
    },
    "simple": {
        "connector": "AscendSimpleCPUOffloadConnector", "module": SIMPLE, "prefix_caching": True,
        "extra": {"cpu_bytes_to_use": 1 << 20},
    },
    "recompute": {
        "connector": "RecomputeCPUOffloadConnector", "module": RECOMPUTE, "prefix_caching": False,
        "extra": {"cpu_bytes_to_use_per_rank": 1 << 20}, "scheduler": PreemptSavingScheduler,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def _prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    prefix = rng.choice(prefixes)[: rng.choice((16, 32, 48, 64))]
    return prefix + [rng.randrange(10, 900) for _ in range(rng.randrange(1, 40))]


@pytest.mark.parametrize("name", list(CASES))
def test_soak(model_dir: Path, name: str) -> None:
    case = CASES[name]
    rng = random.Random(f"soak-{name}")
    threads_before = set(threading.enumerate())
    config = make_config(
        model_dir, case["connector"], case["module"], case["extra"], NUM_BLOCKS,
        tp=2, prefix_caching=case["prefix_caching"],
    )  # fmt: skip
    loop = Loop(config, NUM_BLOCKS, scheduler_cls=case.get("scheduler", Scheduler), fault_rate=FAULT_RATE, seed=7)
    prefixes = [[rng.randrange(10, 900) for _ in range(64)] for _ in range(6)]
    added: dict[str, Any] = {}
    aborted: set[str] = set()
    preempted: set[str] = set()
    try:
        end = time.monotonic() + TRAFFIC_S
        while time.monotonic() < end and len(added) < MAX_REQUESTS:
            while len(loop.sched.waiting) < 4 and len(added) < MAX_REQUESTS:
                rid = f"{name}-{len(added)}"
                added[rid] = loop.add(rid, 0, 0, max_tokens=rng.randrange(1, 64), prompt=_prompt(rng, prefixes))
            if rng.random() < 0.03:  # an abort between steps, as the engine delivers one
                live = [r for r, req in added.items() if not req.is_finished()]
                victim = rng.choice(live)
                loop.sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
                aborted.add(victim)
            out = loop.step()
            preempted.update(out.preempted_req_ids or ())
        for shard in loop.shards:
            shard.runtime.rate = 0.0  # drain without new faults
        list(loop.run(timeout_s=30.0))

        statuses = {req.status for req in added.values()}
        assert statuses <= {RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_ABORTED}, statuses
        for rid, req in added.items():
            if req.status == RequestStatus.FINISHED_LENGTH_CAPPED:
                assert len(req.output_token_ids) == req.max_tokens, rid
        assert not loop.sched.has_requests()
        assert loop.free_blocks() == loop.free_at_start, "a device block is still pinned"
        # the soak did what it says: enough traffic, preemptions, aborts, failures both ways, checked loads
        faults = {d: sum(s.runtime.failed[int(d)] for s in loop.shards) for d in (CopyDirection.H2D, CopyDirection.D2H)}
        print(
            f"{name}: {len(added)} requests, {len(preempted)} preempted, {len(aborted)} aborted, "
            f"{len(loop.verified)} loads verified ({loop.verified_bytes} bytes), faults {faults}, "
            f"{len(loop.failed_recving)} failed_recving, {len(loop.load_errors)} load-error blocks"
        )
        assert len(added) >= 10 * TRAFFIC_S and preempted and aborted  # ~40/s measured on 2 busy cores
        assert faults[CopyDirection.D2H] > 0 and loop.verified_bytes > 0
    finally:
        loop.close()
    left = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    assert not left, f"threads left: {[t.name for t in left]}"
