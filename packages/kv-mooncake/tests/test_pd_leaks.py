"""Thousands of real requests leave no trackers, sockets, threads or registrations behind.

Each wave also has a request that stops on P (EOS on its first token) and one aborted on P: they
lend nothing and must leave no tracker entry on P.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.kv_mooncake.core.engine import MooncakeEngine

REQUESTS = int(os.environ.get("KV_MOONCAKE_LEAK_REQUESTS", "10000"))
WAVE = 500


def _fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


@pytest.mark.timeout(180)
def test_many_requests_leave_nothing_behind(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(p_tp=1, d_tp=1, layers=1, heads=1, head_dim=8, block_size=16, num_blocks=WAVE + 8)
    d = pair.d
    worker = d.ranks[0].worker
    engine = worker._engine
    assert isinstance(engine, MooncakeEngine) and worker.receiver is not None
    fds = threads = -1
    regions = engine.registered
    for start in range(0, REQUESTS, WAVE):
        rids = [f"r{i}" for i in range(start, min(start + WAVE, REQUESTS))]
        for rid, params in zip(rids, pair.p.prefill_many(rids, 16, seed=start), strict=True):
            d.decode(rid, 16, params)
        for end in ("stopped", "aborted"):  # EOS on the first token, a client abort: P lends nothing
            assert pair.p.prefill(f"{end}{start}", 16, seed=start, end=end) == {}
        assert d.wait_recv(set(rids), timeout_s=120.0) == set()
        assert d.verify(rids[-1], seed=start) > 0
        for rid in rids:
            d.finish_decode(rid)
        p_state = pair.wait_p_idle()
        assert (p_state["blocks_lent"], p_state["tracked"]) == (0, 0)  # stopped/aborted ones left nothing
        if start == 0:  # after one wave the pools (threads, pooled sockets) are at their steady size
            fds, threads = _fds(), threading.active_count()
    p_state = pair.p.poll()
    assert (p_state["tracked"], p_state["blocks_lent"], p_state["expired"]) == (0, 0, 0)
    assert worker.receiver.in_flight == 0 and worker.receiver.cached_peers == 1
    assert d.scheduler.tracked == 0 and not d.blocks
    assert engine.registered == regions
    assert _fds() <= fds + 2 and threading.active_count() <= threads
    d.shutdown()
    assert all(key not in engine.registered for key in regions)  # D's registrations released
