"""Layer-wise pushes over every engine KV layout, P and D in separate processes, every byte verified.

Layouts as in ``tests/test_pd_layouts.py`` (`synthetic_layouts`). With P_tp > D_tp, token-major
blocks go through the head -> token all-to-all over gloo; head-major blocks (LBHNC, legacy HND)
need none: each P rank writes its own blocks at its heads' offset of D's block. P_tp < D_tp is
not a layer-wise topology (`decode.tp_size` must divide `prefill.tp_size`). Two P processes cost
~20 s a test here, so the multi-rank cases are the two paths only (head-major direct, token-major
all-to-all on vLLM's permuted views); the other layouts differ from those only in the plain path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ascend_dist.kv_mooncake.core.messages import TensorMeta
from ascend_dist.kv_mooncake.push.plan import resharded_pieces


def _round_trip(pair: Any, p_ranks: int = 1) -> None:
    assert pair.transfer("a", 16 * 5 - 7, seed=1) == set()
    assert pair.d.verify("a", 1) > 0
    pair.d.finish("a")
    assert pair.transfer("b", 16 * 4, seed=2, computed=16) == set()  # a prefix hit on D
    assert pair.d.verify("b", 2, computed_tokens=16) > 0
    pair.d.finish("b")
    assert pair.p_idle() == [0] * p_ranks


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "model",
    [pytest.param({"layout": x}, id=x) for x in ("LBHNC", "LBNHC", "BLHNC", "legacy-NHD", "legacy-HND")]
    + [pytest.param({"layout": "LBHNC", "mla": True}, id="mla-native")],
)
def test_push_is_byte_exact_in_every_layout(make_lw_pair: Callable[..., Any], model: dict[str, Any]) -> None:
    _round_trip(make_lw_pair(**model))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("p_tp", "d_tp", "layout"),
    [
        pytest.param(2, 1, "LBHNC", id="tp2-1-head-major-no-alltoall"),
        pytest.param(2, 1, "LBNHC", id="tp2-1-native-token-major-alltoall"),
    ],
)
def test_multi_rank_push_is_byte_exact_in_every_layout(
    make_lw_pair: Callable[..., Any], p_tp: int, d_tp: int, layout: str
) -> None:
    _round_trip(make_lw_pair(p_tp, d_tp, p_procs=True, layout=layout), p_ranks=p_tp)


@pytest.mark.timeout(60)
def test_p_on_another_layout_is_refused_naming_both(make_lw_pair: Callable[..., Any]) -> None:
    pair = make_lw_pair(layout="LBNHC", p_model={"layout": "LBHNC"}, d_extra={"first_layer_timeout_s": 30.0})
    pair.d.announce("x", 40)
    pair.send_prefill(pair.metaserver.take("x"), 40, seed=1)
    pair.read_prefill()
    assert pair.d.wait_recv({"x"}, timeout_s=5.0) == {b for ids in pair.d.blocks["x"] for b in ids}
    reason = pair.d.ranks[0].worker.failure_reasons["x"]
    # P names its own layout; D's refusal never discloses D's.
    assert "layout differs" in reason and "kv/LBHNC" in reason and "kv/LBNHC" not in reason, reason


def test_head_major_resharded_pieces_read_p_blocks_in_place() -> None:
    """No staging: each P block (its stride, not the staging pitch) lands at ``member * P_block_len``."""
    p = TensorMeta(0x1000, 256, 1024, 16, 2, 8, True)  # block-outermost on P: 1 KiB between blocks
    d = TensorMeta(0x9000, 512, 512, 16, 4, 8, True)
    lo, ro, ln = resharded_pieces((), [p], [d], [3, 5], [1, 2], member=1, ratio=2)
    assert (lo, ro, ln) == (
        [0x1000 + 3 * 1024, 0x1000 + 5 * 1024],
        [0x9000 + 512 + 256, 0x9000 + 1024 + 256],
        [256, 256],
    )
