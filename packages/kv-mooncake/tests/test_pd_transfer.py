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
