"""Side-channel port-offset scheme: worked examples, the inverse, and range validation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.mappings import PortLayout as ReexportedLayout
from ascend_dist.kv_mooncake.core.ports import PortLayout, PortScheme, RankCoord


def test_spec_example_tp8_dp2() -> None:
    layout = PortLayout(kv_port=36000, tp_size=8, dp_size=2)
    assert [layout.port(RankCoord(tp_rank=t)) for t in range(8)] == list(range(36000, 36008))
    assert [layout.port(RankCoord(tp_rank=t, dp_rank=1)) for t in range(8)] == list(range(36008, 36016))
    assert layout.dp_base(1) == 36008
    assert layout.max_port == 36015


def test_spec_example_pp2() -> None:
    layout = PortLayout(kv_port=36000, tp_size=8, pp_size=2, dp_size=2)
    assert layout.port(RankCoord(tp_rank=3, pp_rank=1)) == 36011
    assert layout.dp_base(1) == 36016
    assert layout.rank(36011) == RankCoord(tp_rank=3, pp_rank=1)


def test_pull_scheme_with_pcp_orders_pp_then_pcp_then_tp() -> None:
    layout = PortLayout(kv_port=30000, tp_size=4, pp_size=2, pcp_size=2, dp_size=2)
    # device_index = (pp_rank * pcp + pcp_rank) * tp + tp_rank; base = kv + dp * tp*pp*pcp
    assert layout.port(RankCoord(tp_rank=1, pp_rank=1, pcp_rank=0, dp_rank=1)) == 30000 + 16 + (1 * 2 + 0) * 4 + 1


def test_layerwise_scheme_matches_spec_formula() -> None:
    # base = kv_port + dp*pcp*tp + pcp_rank*tp; port = base + tp_rank
    layout = PortLayout(kv_port=40000, tp_size=4, pcp_size=2, dp_size=3, scheme=PortScheme.LAYERWISE)
    for dp in range(3):
        for pcp in range(2):
            for tp in range(4):
                expected = 40000 + dp * 2 * 4 + pcp * 4 + tp
                assert layout.port(RankCoord(tp_rank=tp, pcp_rank=pcp, dp_rank=dp)) == expected


def test_rank_coord_dcp_rank() -> None:
    assert RankCoord(tp_rank=5).dcp_rank(2) == 1
    assert RankCoord(tp_rank=5).dcp_rank(1) == 0


def test_mappings_reexports_port_layout() -> None:
    assert ReexportedLayout is PortLayout


@settings(max_examples=60, deadline=None)
@given(
    tp=st.integers(1, 8),
    pp=st.integers(1, 3),
    pcp=st.integers(1, 3),
    dp=st.integers(1, 3),
    kv_port=st.integers(1024, 50000),
)
def test_port_and_rank_are_inverse_bijections(tp: int, pp: int, pcp: int, dp: int, kv_port: int) -> None:
    layout = PortLayout(kv_port=kv_port, tp_size=tp, pp_size=pp, pcp_size=pcp, dp_size=dp)
    coords = [
        RankCoord(tp_rank=t, pp_rank=p, pcp_rank=c, dp_rank=d)
        for d in range(dp)
        for p in range(pp)
        for c in range(pcp)
        for t in range(tp)
    ]
    ports = [layout.port(c) for c in coords]
    assert ports == list(range(kv_port, layout.max_port + 1)), "dense, in (dp, pp, pcp, tp) order"
    assert [layout.rank(p) for p in ports] == coords


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kv_port": 65530, "tp_size": 8}, "kv_port"),
        ({"kv_port": 0, "tp_size": 8}, "kv_port"),
        ({"kv_port": 30000, "tp_size": 0}, "tp_size"),
        ({"kv_port": 30000, "tp_size": 2, "pcp_size": 2, "scheme": PortScheme.HYBRID}, "pcp_size"),
        ({"kv_port": 30000, "tp_size": 2, "pp_size": 2, "scheme": PortScheme.LAYERWISE}, "pp_size"),
    ],
)
def test_layout_rejects_bad_config(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        PortLayout(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_highest_port_65535_is_allowed() -> None:
    assert PortLayout(kv_port=65528, tp_size=8).max_port == 65535


@pytest.mark.parametrize(
    ("coord", "field"),
    [
        (RankCoord(tp_rank=8), "tp_rank"),
        (RankCoord(tp_rank=-1), "tp_rank"),
        (RankCoord(tp_rank=0, pp_rank=1), "pp_rank"),
        (RankCoord(tp_rank=0, pcp_rank=1), "pcp_rank"),
        (RankCoord(tp_rank=0, dp_rank=2), "dp_rank"),
    ],
)
def test_port_rejects_out_of_range_ranks(coord: RankCoord, field: str) -> None:
    layout = PortLayout(kv_port=30000, tp_size=8, dp_size=2)
    with pytest.raises(ConfigError) as info:
        layout.port(coord)
    assert info.value.field == field


@pytest.mark.parametrize("port", [29999, 30016])
def test_rank_rejects_foreign_port(port: int) -> None:
    layout = PortLayout(kv_port=30000, tp_size=8, dp_size=2)
    with pytest.raises(ConfigError) as info:
        layout.rank(port)
    assert info.value.field == "port"
    assert "[30000, 30015]" in str(info.value)
