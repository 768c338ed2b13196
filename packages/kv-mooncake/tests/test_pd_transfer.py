"""Real two-process P -> D pulls over Mooncake TCP, every byte verified on D."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

TOPOLOGIES = [
    pytest.param({"p_tp": 1, "d_tp": 1}, id="tp1-1"),
    pytest.param({"p_tp": 2, "d_tp": 1}, id="tp2-1"),
    pytest.param({"p_tp": 4, "d_tp": 2, "heads": 2}, id="tp4-2-replicated-heads"),
    pytest.param({"p_tp": 1, "d_tp": 2}, id="tp1-2"),
    pytest.param({"p_tp": 2, "d_tp": 1, "mla": True}, id="mla-tp2-1"),
    pytest.param({"p_tp": 1, "d_tp": 1, "groups": 2}, id="two-kv-groups"),
    pytest.param({"p_tp": 2, "d_tp": 2, "p_pp": 2}, id="pp2-on-p"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", TOPOLOGIES)
def test_pull_is_byte_exact(make_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    pair = make_pair(**topo)
    assert pair.transfer("r0", 70, seed=1) == set()
    assert pair.d.verify("r0", 1) > 0
    pair.d.finish_decode("r0")
    # D already holds the first block (prefix hit): only the rest is pulled, into fresh blocks.
    assert pair.transfer("r1", 50, seed=2, computed=16) == set()
    assert pair.d.verify("r1", 2, computed_tokens=16) > 0
    pair.d.finish_decode("r1")
    p_state = pair.wait_p_idle()
    assert p_state["blocks_lent"] == 0 and p_state["tracked"] == 0 and p_state["expired"] == 0
    assert p_state["late_dones"] == 0  # P waited for exactly the DONEs D sent
    assert all(r.worker.receiver is not None and r.worker.receiver.in_flight == 0 for r in pair.d.ranks)
    assert pair.d.scheduler.tracked == 0


@pytest.mark.timeout(60)
def test_fragmented_blocks_above_the_engine_piece_limit(make_pair: Callable[..., Any]) -> None:
    """Many discontiguous blocks over several D ranks: > 2,048 pieces to one peer, split and capped."""
    pair = make_pair(p_tp=1, d_tp=4, block_size=4, num_blocks=200, layers=8)
    # Fragment P's free list so the request's blocks are not contiguous.
    for i in range(4):
        pair.transfer(f"w{i}", 4 * 3, seed=i)
        pair.d.finish_decode(f"w{i}")
    pair.wait_p_idle()
    assert pair.transfer("big", 4 * 60, seed=99) == set()
    assert pair.d.verify("big", 99) > 0


@pytest.mark.timeout(60)
def test_swa_group_with_d_prefix_hit_is_tail_aligned(make_pair: Callable[..., Any]) -> None:
    """Group 1 is a sliding window of 3 blocks: P sends its last 3 prompt blocks; D has a prefix hit."""
    pair = make_pair(p_tp=1, d_tp=1, groups=2, windows=[0, 3])
    # 7 prompt blocks, D holds 2: group 0 pulls blocks 2..6, group 1 only the window (blocks 4..6).
    assert pair.transfer("s0", 16 * 7 - 5, seed=5, computed=32) == set()
    assert pair.d.verify("s0", 5, computed_tokens=32) > 0
    pair.d.finish_decode("s0")
    # Prefix hit inside the window: D pulls only blocks 5..6 of the SWA group.
    assert pair.transfer("s1", 16 * 7, seed=6, computed=80) == set()
    assert pair.d.verify("s1", 6, computed_tokens=80) > 0
    pair.d.finish_decode("s1")
    assert pair.wait_p_idle()["blocks_lent"] == 0


CP_TOPOLOGIES = [
    pytest.param({"p_tp": 1, "d_tp": 1, "p_cp": (2, 1)}, id="p-pcp2-tp1-1"),
    pytest.param({"p_tp": 2, "d_tp": 1, "p_cp": (2, 1)}, id="p-pcp2-tp2-1-stacked"),
    pytest.param({"p_tp": 2, "d_tp": 1, "p_cp": (2, 2), "mla": True}, id="mla-p-pcp2-dcp2"),
    pytest.param({"p_tp": 2, "d_tp": 2, "p_cp": (2, 1), "d_cp": (1, 2), "mla": True}, id="mla-p-pcp2-d-dcp2"),
    pytest.param({"p_tp": 1, "d_tp": 1, "p_cp": (2, 1), "d_cp": (2, 1)}, id="pcp2-both-sides"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", CP_TOPOLOGIES)
def test_cp_pull_is_byte_exact(make_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    """Context parallelism: each D rank pulls its blocks from the P CP ranks that hold them."""
    pair = make_pair(**topo)
    assert pair.transfer("c0", 16 * 7 - 3, seed=3) == set()  # 7 blocks: the final block on a CP rank != 0
    assert pair.d.verify("c0", 3) > 0
    pair.d.finish_decode("c0")
    hit = 48 if pair.d.cp == 1 else 64  # a prefix hit (whole CP rounds when D has CP)
    assert pair.transfer("c1", 16 * 9, seed=4, computed=hit) == set()
    assert pair.d.verify("c1", 4, computed_tokens=hit) > 0
    pair.d.finish_decode("c1")
    p_state = pair.wait_p_idle()
    assert p_state["blocks_lent"] == 0 and p_state["tracked"] == 0 and p_state["expired"] == 0
    assert p_state["late_dones"] == 0  # P waited for exactly the DONEs D sent
