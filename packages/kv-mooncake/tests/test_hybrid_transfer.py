"""Hybrid models over the real pull: attention and state (Mamba/GDN) groups in two processes.

P (a child process) and D (this process) run the package's scheduler and workers over Mooncake
TCP. Layer ``i`` belongs to group ``i % groups``; the state group's layers hold a conv and an ssm
state per block, sharded over TP as vLLM shards GDN layers. D verifies every attention block and
its state block against the contents P computed, including the assembly of ``P_tp / D_tp`` state
shards (conv Q/K/V interleave, stacked ssm heads) into one D shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

HYBRID = [
    pytest.param({"p_tp": 1, "d_tp": 1}, id="tp1-1"),
    pytest.param({"p_tp": 2, "d_tp": 1}, id="tp2-1-state-ratio2"),
    pytest.param({"p_tp": 4, "d_tp": 2, "heads": 2}, id="tp4-2-replicated-heads"),
    pytest.param({"p_tp": 2, "d_tp": 2, "p_pp": 2}, id="pp2-on-p"),
    pytest.param({"p_tp": 1, "d_tp": 1, "groups": 3, "windows": [0, 0, 3]}, id="attention-state-swa"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", HYBRID)
def test_hybrid_pull_is_byte_exact(make_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    spec = {"groups": 2, "state_groups": [1], **topo}
    pair = make_pair(**spec)
    prompt = 16 * 4 + 1  # P computes 64 tokens (the last prompt token is dropped), D loads 64
    params = pair.p.prefill("h0", prompt, seed=11)
    assert params["remote_block_ids"][0] == params["remote_block_ids"][0][:4]
    assert len(params["remote_block_ids"][0]) == 4  # ceil(64 / 16): truncated on P
    assert pair.d.decode("h0", prompt, params) == prompt - 1  # D recomputes the last token
    assert pair.d.wait_recv({"h0"}, 15.0) == set()
    assert pair.d.verify("h0", 11) > 0
    pair.d.finish_decode("h0")
    p_state = pair.wait_p_idle()
    assert p_state["blocks_lent"] == 0 and p_state["tracked"] == 0 and p_state["expired"] == 0
    assert p_state["late_dones"] == 0  # P waited for exactly the DONEs D sent
    assert pair.d.scheduler.tracked == 0


CP_GROUPS = [
    pytest.param({"p_tp": 1, "d_tp": 1, "p_cp": (2, 1)}, id="p-pcp2-two-groups"),
    pytest.param({"p_tp": 2, "d_tp": 1, "p_cp": (2, 1)}, id="p-pcp2-tp2-1-stacked-two-groups"),
    pytest.param(
        {"p_tp": 2, "d_tp": 2, "p_cp": (2, 1), "d_cp": (1, 2), "mla": True}, id="mla-p-pcp2-d-dcp2-two-groups"
    ),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", CP_GROUPS)
def test_cp_with_two_full_attention_groups_is_byte_exact(make_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    """Context parallelism with two full-attention KV groups: each group's blocks are planned on their own."""
    pair = make_pair(groups=2, **topo)
    assert pair.transfer("g0", 16 * 7 - 3, seed=21) == set()
    assert pair.d.verify("g0", 21) > 0
    pair.d.finish_decode("g0")
    hit = 48 if pair.d.cp == 1 else 64
    assert pair.transfer("g1", 16 * 9, seed=22, computed=hit) == set()
    assert pair.d.verify("g1", 22, computed_tokens=hit) > 0
    pair.d.finish_decode("g1")
    p_state = pair.wait_p_idle()
    assert p_state["blocks_lent"] == 0 and p_state["tracked"] == 0 and p_state["expired"] == 0
    assert p_state["late_dones"] == 0  # P waited for exactly the DONEs D sent


@pytest.mark.timeout(60)
def test_hybrid_p_dies_d_reports_attention_and_state_blocks(make_pair: Callable[..., Any]) -> None:
    pair = make_pair(groups=2, state_groups=[1], pull_timeout_s=5.0, own_process=True)
    assert pair.transfer("ok", 40, seed=1) == set()
    params = pair.p.prefill("lost", 40, 2)
    pair.p.peer.kill()
    pair.d.decode("lost", 40, params)
    errors = pair.d.wait_recv({"lost"}, timeout_s=10.0)
    assert errors == {b for ids in pair.d.blocks["lost"] for b in ids}  # the state block too
    assert pair.d.verify("ok", 1) > 0


@pytest.mark.timeout(60)
def test_d_seeing_other_state_groups_recomputes_and_p_frees(make_pair: Callable[..., Any]) -> None:
    """P is hybrid, D's model has no state group: D refuses to pair the groups and loads nothing."""
    from ascend_dist.kv_mooncake._demo.synthetic import Model, SyntheticInstance

    pair = make_pair(groups=2, state_groups=[1])
    spec = {"layers": 4, "heads": 4, "head_dim": 16, "block_size": 16, "num_blocks": 32, "groups": 2}
    other = SyntheticInstance(pair.d.config, Model(**spec))
    try:
        params = pair.p.prefill("x", 40, 3)
        assert other.decode("x", 40, params) == 0  # recomputed on D, nothing pulled
        assert pair.wait_p_idle()["blocks_lent"] == 0  # the empty receive's DONE freed P's blocks
    finally:
        other.shutdown()


KERNEL_BLOCKS = [
    pytest.param({"p_model": {"block_size": 32, "kernel_block_size": 16}}, id="p-block32-d-block16"),
    pytest.param({"kernel_block_size": 8}, id="kernel8-both"),
    pytest.param({"p_tp": 2, "d_tp": 1, "kernel_block_size": 8}, id="kernel8-tp2-1-stacked"),
    pytest.param({"p_tp": 1, "d_tp": 2, "p_model": {"block_size": 32, "kernel_block_size": 16}}, id="p-block32-tp1-2"),
    pytest.param({"groups": 2, "windows": [0, 3], "kernel_block_size": 8}, id="kernel8-swa"),
    pytest.param({"groups": 2, "state_groups": [1], "kernel_block_size": 8}, id="kernel8-hybrid-state"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", KERNEL_BLOCKS)
def test_kernel_blocks_and_unequal_block_sizes(make_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    """Logical blocks split into kernel blocks, and P's block twice D's."""
    pair = make_pair(**topo)
    assert pair.transfer("k0", 16 * 7 - 3, seed=31) == set()
    assert pair.d.verify("k0", 31) > 0
    pair.d.finish_decode("k0")
    # D's prefix hit of one D block is half of a P block when P's block is 32 tokens.
    assert pair.transfer("k1", 16 * 9, seed=32, computed=16) == set()
    assert pair.d.verify("k1", 32, computed_tokens=16) > 0
    pair.d.finish_decode("k1")
    assert pair.wait_p_idle()["blocks_lent"] == 0


CP_STATE = [
    pytest.param({"p_tp": 1, "d_tp": 1, "p_cp": (2, 1)}, id="p-pcp2"),
    pytest.param({"p_tp": 2, "d_tp": 1, "p_cp": (2, 1)}, id="p-pcp2-tp2-1-state-ratio2"),
    pytest.param({"p_tp": 2, "d_tp": 2, "p_cp": (2, 1), "d_cp": (1, 2), "mla": True}, id="mla-p-pcp2-d-dcp2"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", CP_STATE)
def test_cp_hybrid_attention_and_state_is_byte_exact(make_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    """CP with a state group: attention blocks from the CP ranks holding them, the state from P's PCP rank 0."""
    pair = make_pair(groups=2, state_groups=[1], **topo)
    assert pair.transfer("cs0", 16 * 7 - 2, seed=41) == set()
    assert pair.d.verify("cs0", 41) > 0
    pair.d.finish_decode("cs0")
    hit = 48 if pair.d.cp == 1 else 64  # a prefix hit on D: the state is still pulled
    assert pair.transfer("cs1", 16 * 9 + 1, seed=42, computed=hit) == set()
    assert pair.d.verify("cs1", 42, computed_tokens=hit) > 0
    pair.d.finish_decode("cs1")
    p_state = pair.wait_p_idle()
    assert p_state["blocks_lent"] == 0 and p_state["tracked"] == 0 and p_state["expired"] == 0
    assert p_state["late_dones"] == 0  # P waited for exactly the DONEs D sent


CP_BLOCKS = [
    pytest.param({"p_tp": 1, "d_tp": 1, "p_cp": (2, 1)}, id="p-pcp2-bp16-bd32"),
    pytest.param({"p_tp": 2, "d_tp": 1, "p_cp": (2, 1)}, id="p-pcp2-tp2-1-stacked-bp16-bd32"),
    pytest.param({"p_tp": 2, "d_tp": 2, "p_cp": (2, 2), "d_cp": (1, 1), "mla": True}, id="mla-p-pcp2-dcp2-bp16-bd32"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", CP_BLOCKS)
def test_cp_with_d_block_a_multiple_of_p_block(make_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    """CP with D's block (32) twice P's (16): D's blocks are read as P-sized sub-blocks."""
    pair = make_pair(block_size=32, p_model={"block_size": 16}, groups=2, **topo)
    assert pair.transfer("b0", 16 * 7 - 3, seed=51) == set()
    assert pair.d.verify("b0", 51) > 0
    pair.d.finish_decode("b0")
    assert pair.transfer("b1", 16 * 9, seed=52, computed=32) == set()
    assert pair.d.verify("b1", 52, computed_tokens=32) > 0
    pair.d.finish_decode("b1")
    p_state = pair.wait_p_idle()
    assert p_state["blocks_lent"] == 0 and p_state["tracked"] == 0 and p_state["expired"] == 0
    assert p_state["late_dones"] == 0
