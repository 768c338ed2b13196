"""Real two-process SFA remote-D2H reads over Mooncake TCP, every byte verified on D."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

TOPOLOGIES = [
    pytest.param({"p_tp": 1, "d_tp": 1}, id="tp1-1"),
    pytest.param({"p_tp": 2, "d_tp": 1}, id="tp2-1-two-contributors"),
    pytest.param({"p_tp": 2, "d_tp": 2}, id="tp2-2-main-split"),
    pytest.param({"p_tp": 4, "d_tp": 2, "indexer_dims": (8, 2)}, id="tp4-2-indexer-scale"),
    pytest.param({"p_tp": 1, "d_tp": 1, "indexer_dims": ()}, id="no-indexer"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", TOPOLOGIES)
def test_layerwise_read_is_byte_exact(make_sfa_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    pair = make_sfa_pair(**topo)
    pair.run("r0", 61, seed=1)
    assert pair.d.wait_recv({"r0"}) == set()
    assert pair.d.verify("r0", 1) > 0
    # Chunked prefill (3 chunks, partial blocks carried over) with a prefix hit on D; P reuses r0's blocks.
    pair.run("r1", 70, seed=2, computed=16, chunk=24)
    assert pair.d.wait_recv({"r1"}) == set()
    assert pair.d.verify("r1", 2, computed=16) > 0
    drained = pair.p.drain()
    assert drained["failed"] == {}
    pair.d.finish("r0")
    pair.d.finish("r1")
    assert all(w.pending == 0 for w in pair.d.workers)
    assert pair.d.scheduler.tracked == 0


@pytest.mark.timeout(60)
def test_many_requests_back_to_back_reuse_p_blocks_behind_the_gates(make_sfa_pair: Callable[..., Any]) -> None:
    """P frees each request's blocks at once and reuses them first: only the gates keep D's bytes right."""
    pair = make_sfa_pair(p_tp=2, d_tp=2)
    rids = [f"q{i}" for i in range(6)]
    items = []
    for i, rid in enumerate(rids):
        params = pair.d.decode(rid, 40 + i, 0)
        items.append({"rid": f"p-{rid}", "prompt_len": 40 + i, "seed": 10 + i, "params": params, "chunk": 16})
    pair.p.prefill(items)
    assert pair.d.wait_recv(set(rids)) == set()
    for i, rid in enumerate(rids):
        assert pair.d.verify(rid, 10 + i) > 0
        pair.d.finish(rid)
    assert pair.p.drain()["failed"] == {}


@pytest.mark.timeout(60)
def test_requests_batched_in_the_same_steps(make_sfa_pair: Callable[..., Any]) -> None:
    """Several requests per step (one read batch per layer and endpoint), chunked, P_tp 4 -> D_tp 2."""
    pair = make_sfa_pair(p_tp=4, d_tp=2)
    items = []
    for i, (prompt, hit) in enumerate([(45, 0), (64, 16), (9, 0), (33, 8)]):
        params = pair.d.decode(f"b{i}", prompt, hit)
        items.append({"rid": f"p-b{i}", "prompt_len": prompt, "seed": 20 + i, "params": params, "chunk": 20})
    assert pair.p.prefill_batch(items) == 4  # the longest prompt needs 4 chunks of 20 tokens
    assert pair.d.wait_recv({f"b{i}" for i in range(4)}) == set()
    for i, hit in enumerate([0, 16, 0, 8]):
        assert pair.d.verify(f"b{i}", 20 + i, computed=hit) > 0
    assert pair.p.drain()["failed"] == {}


@pytest.mark.timeout(60)
def test_transfer_after_an_idle_gap(make_sfa_pair: Callable[..., Any]) -> None:
    """Mooncake #4209: the first TCP transfer after ~5 s idle failed upstream; D retries a failed read once."""
    pair = make_sfa_pair()
    pair.run("g0", 30, seed=30)
    assert pair.d.wait_recv({"g0"}) == set()
    time.sleep(6.0)
    pair.run("g1", 30, seed=31)
    assert pair.d.wait_recv({"g1"}) == set()
    assert pair.d.verify("g1", 31) > 0
