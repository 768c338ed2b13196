"""Thousands of layer-wise requests, some of them failing, leave nothing behind on P or D.

Each wave pushes requests P and D both finish, plus two faults: one request P never pushes (D gives
up at ``first_layer_timeout_s`` and reports every block a load error) and one D aborts before P
pushes (P's claim is answered ``unknown``: it writes nothing). Afterwards D's receiver and both
schedulers hold no request, P's send thread no failure, the reuse gates are open, and threads,
file descriptors and registrations are back at their steady size. Real Mooncake TCP and ZMQ on
127.0.0.1, P and D in this process.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver, LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig

REQUESTS = int(os.environ.get("KV_MOONCAKE_LW_LEAK_REQUESTS", "10000"))
WAVE = 200


def _fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


@pytest.mark.timeout(240)
def test_many_requests_with_faults_leave_nothing_behind() -> None:
    port = free_port_range(1)
    extra: dict[str, Any] = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}
    shape: dict[str, Any] = {"layers": 2, "heads": 1, "head_dim": 8, "block_size": 16}
    ms = CollectingMetaserver()
    d_cfg = LayerwiseConfig.from_kv_transfer_config(
        engine_id="leakD", kv_role="kv_consumer", kv_port=port, extra={**extra, "first_layer_timeout_s": 0.3}
    )
    p_cfg = LayerwiseConfig.from_kv_transfer_config(engine_id="leakP", kv_role="kv_producer", kv_port=port, extra=extra)
    d_engine, p_engine = MooncakeEngine("127.0.0.1"), MooncakeEngine("127.0.0.1")
    d = LwInstance(d_cfg, Model(**shape, num_blocks=2 * WAVE + 8), engine=d_engine, metaserver=ms)
    p = LwInstance(p_cfg, Model(**shape, num_blocks=16), engine=p_engine)
    d_regions, p_regions = d_engine.registered, p_engine.registered
    fds = threads = -1
    try:
        for start in range(0, REQUESTS, WAVE):
            rids = [f"r{i}" for i in range(start, min(start + WAVE, REQUESTS))]
            never, aborted = f"never{start}", f"aborted{start}"
            for i, rid in enumerate(rids):  # D announces each just before P prefills it (as a proxy paces them)
                d.announce(rid, 24)
                p.prefill(ms.take(rid), 24, seed=start + i)
            d.announce(never, 24)  # the proxy never reaches P with it
            ms.take(never)
            d.announce(aborted, 24)
            late = ms.take(aborted)
            d.finish(aborted)  # the client went away before P pushed
            p.prefill(late, 24, seed=0)  # P arrives after D dropped it: nothing may land
            p.wait_idle()
            errors = d.wait_recv({*rids, never}, timeout_s=60.0)
            assert errors == set(d.blocks[never][0])  # only the one P never pushed: D gave up on it
            assert d.verify(rids[0], seed=start) > 0 and d.verify(rids[-1], seed=start + len(rids) - 1) > 0
            for rid in [*rids, never]:
                d.finish(rid)
            if start == 0:  # after one wave the pools (threads, pooled sockets) are at their steady size
                fds, threads = _fds(), threading.active_count()
        d_worker, p_worker = d.ranks[0].worker, p.ranks[0].worker
        assert d_worker.receiver is not None and len(d_worker.receiver) == 0
        assert d.scheduler.tracked == 0 and p.scheduler.tracked == 0
        assert not d.blocks and not p.blocks
        assert p_worker._producer is not None and len(p_worker._producer.sender._failed) <= 1  # the aborted one
        assert d_engine.registered == d_regions and p_engine.registered == p_regions
        assert _fds() <= fds + 2 and threading.active_count() <= threads
    finally:
        p.shutdown()
        d.shutdown()
