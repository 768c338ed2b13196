"""Pulls over every engine KV layout, P and D in two processes over Mooncake TCP, every byte verified.

Layouts (`synthetic_layouts`): vllm-ascend's (K, V) tuple, vLLM >= 0.32's ``[B, H, N, C]`` views
in LBHNC (head-major, vLLM's CPU attention), LBNHC (token-major) and BLHNC (block-outermost),
legacy ``[2, B, N, H, D]`` tensors stored NHD and HND, and MLA; each for P_tp = D_tp, P_tp > D_tp
(stacked: head-major blocks need no reformat) and P_tp < D_tp (rows: head-major is one piece per
block). Unservable layouts are refused at registration, different layouts at the handshake.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from ascend_dist.common.errors import LayoutError
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake._demo.synthetic import Model, SyntheticInstance
from ascend_dist.kv_mooncake.core.messages import GetMeta, Refused
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.messages import reply_codec, request_codec

LAYOUTS = ["", "LBHNC", "LBNHC", "BLHNC", "legacy-NHD", "legacy-HND"]
TP = [
    pytest.param({"p_tp": 1, "d_tp": 1}, id="tp1-1"),
    pytest.param({"p_tp": 2, "d_tp": 1}, id="tp2-1"),
    pytest.param({"p_tp": 1, "d_tp": 2}, id="tp1-2"),
]


def _round_trip(pair: Any) -> None:
    assert pair.transfer("a", 70, seed=1) == set()
    assert pair.d.verify("a", 1) > 0
    pair.d.finish_decode("a")
    assert pair.transfer("b", 50, seed=2, computed=16) == set()  # a prefix hit on D
    assert pair.d.verify("b", 2, computed_tokens=16) > 0
    pair.d.finish_decode("b")
    state = pair.wait_p_idle()
    assert (state["blocks_lent"], state["expired"], state["late_dones"]) == (0, 0, 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("topo", TP)
@pytest.mark.parametrize("layout", [pytest.param(x, id=x or "ascend-tuple") for x in LAYOUTS])
def test_pull_is_byte_exact_in_every_layout(make_pair: Callable[..., Any], layout: str, topo: dict[str, Any]) -> None:
    _round_trip(make_pair(**topo, layout=layout))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "topo",
    [
        pytest.param({"p_tp": 2, "d_tp": 1, "mla": True, "layout": "LBHNC"}, id="mla-native-tp2-1"),
        pytest.param({"p_tp": 1, "d_tp": 2, "mla": True, "layout": "LBNHC"}, id="mla-native-tp1-2"),
        pytest.param({"p_tp": 2, "d_tp": 1, "mla": True, "layout": "legacy-NHD"}, id="mla-3d-tp2-1"),
        pytest.param({"p_tp": 4, "d_tp": 1, "layout": "LBHNC"}, id="one-head-per-p-rank-stacked"),
        pytest.param({"p_tp": 1, "d_tp": 4, "layout": "legacy-HND"}, id="one-head-per-d-rank-rows"),
        pytest.param({"p_tp": 2, "d_tp": 1, "layout": "LBHNC", "kernel_block_size": 8}, id="kernel-blocks"),
        pytest.param({"p_tp": 2, "d_tp": 1, "layout": "BLHNC", "p_cp": (2, 1)}, id="cp-pcp2-stacked"),
    ],
)
def test_pull_is_byte_exact_mla_kernel_and_cp(make_pair: Callable[..., Any], topo: dict[str, Any]) -> None:
    _round_trip(make_pair(**topo))


@pytest.mark.timeout(60)
def test_cp_sub_blocks_of_head_major_blocks(make_pair: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    """CP with D's block twice P's: one head (MLA) reads fine; several heads cannot (one run per head)."""
    mla = make_pair(p_tp=2, d_tp=1, p_cp=(2, 1), mla=True, layout="LBHNC", block_size=32, p_model={"block_size": 16})
    assert mla.transfer("m", 16 * 7 - 3, seed=7) == set()
    assert mla.d.verify("m", 7) > 0
    gqa = make_pair(p_tp=1, d_tp=1, p_cp=(2, 1), layout="LBHNC", block_size=32, p_model={"block_size": 16})
    with caplog.at_level(logging.ERROR, logger="ascend_dist.kv_mooncake.pull.threads"):
        assert gqa.transfer("g", 16 * 7 - 3, seed=8) == set(gqa.d.blocks["g"][0])  # refused: D recomputes
    assert "D block order='head-major' is invalid" in caplog.text
    assert gqa.wait_p_idle()["blocks_lent"] == 0


def test_a_layout_with_heads_outside_blocks_is_refused_at_registration() -> None:
    cfg = PullConfig.from_kv_transfer_config(
        engine_id="D-lhbnc",
        kv_role="kv_consumer",
        kv_port=40000,
        extra={"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}},
        model="synthetic",
        dtype="int16",
    )
    with pytest.raises(LayoutError, match=r"kv_cache_layout='LHBNC' is invalid: expected .*dense"):
        SyntheticInstance(cfg, Model(layers=2, heads=4, head_dim=16, num_blocks=8, layout="LHBNC"))


@pytest.mark.timeout(60)
def test_p_and_d_on_different_layouts_are_refused_at_the_handshake(
    make_pair: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    pair = make_pair(p_tp=1, d_tp=1, layout="LBNHC", p_model={"layout": "LBHNC"})
    handshake = pair.d.ranks[0].worker.make_handshake(16)
    assert dict(handshake.compat_fields)["layout"] == "kv/LBNHC"
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)
    with RpcClient(timeout_s=0.5, retries=1) as client:
        body = client.request(
            tcp_endpoint("127.0.0.1", pair.kv_port), requests.encode(GetMeta(handshake=handshake, engine_id="D-probe"))
        )
    reply = replies.decode(body)  # P's own answer: both layouts named
    assert isinstance(reply, Refused) and (reply.field, reply.local, reply.remote) == ("layout", "", "kv/LBNHC")
    with caplog.at_level(logging.ERROR, logger="ascend_dist.kv_mooncake.pull.threads"):
        errors = pair.transfer("x", 40, seed=1)
    assert errors == set(pair.d.blocks["x"][0])  # nothing read: every block reported, vLLM recomputes
    # D names its own layout; P's refusal never tells D (or a prober) P's own.
    assert "layout differs (local='kv/LBNHC', remote='(not disclosed)')" in caplog.text
    assert pair.wait_p_idle()["blocks_lent"] == 0  # D's DONE still freed P
