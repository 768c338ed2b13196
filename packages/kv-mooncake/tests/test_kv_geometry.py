"""Block geometry read from strides (every engine layout), and head-major descriptors byte for byte.

vLLM's layouts are rebuilt from their rule (`synthetic_layouts.layout_strides`, one flat buffer
viewed with ``as_strided``); the descriptor tests run the planned copies over one numpy byte
array and compare every destination byte with what P holds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_dist.common.errors import LayoutError
from ascend_dist.kv_mooncake._demo.synthetic_layouts import build_attention_caches, layout_strides
from ascend_dist.kv_mooncake.core.blocks import TensorGeom
from ascend_dist.kv_mooncake.core.kv_geometry import CacheLayout, block_geometry, layout_label
from ascend_dist.kv_mooncake.core.kv_views import label_kv_caches, tensor_geometry, token_rows
from ascend_dist.kv_mooncake.core.ranks import HeadSlice, select_sources
from ascend_dist.kv_mooncake.pull.slice_bytes import build_pull_descriptors

B, H, N, D = 6, 4, 8, 16  # blocks, heads, tokens, elements per head (K and V: 2 * D in vLLM's views)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


def _native(layout: str, heads: int = H, dims: tuple[int, ...] = (D, D)) -> tuple[dict, CacheLayout]:
    built = build_attention_caches(layout, NAMES, blocks=B, tokens=N, heads=heads, dims=dims)
    return label_kv_caches(built.raw, native=True, layout_name=layout)


@pytest.mark.parametrize(
    ("layout", "head_major", "stride_blocks"),
    [("LBHNC", True, 1), ("LBNHC", False, 1), ("BLHNC", True, 3), ("BLNHC", False, 3)],
)
def test_vllm_native_views_are_read_from_their_strides(layout: str, head_major: bool, stride_blocks: int) -> None:
    parts, lay = _native(layout)
    assert lay.name == layout and lay.axes_of(NAMES[0], 4) == "BHNC"
    block = H * N * 2 * D * 2  # int16, K and V fused
    for name in NAMES:
        (t,) = parts[name]
        assert tuple(t.shape) == (B, H, N, 2 * D)
        g = tensor_geometry(name, t, B, lay)
        assert (g.tokens, g.heads, g.head_bytes, g.block_len) == (N, H, 2 * D * 2, block)
        assert g.head_major is head_major
        assert g.stride == block * stride_blocks  # block-outermost: the other layers' pages in between
    assert layout_label(lay, []) == layout


def test_vllm_stride_rule_matches_the_layout_names() -> None:
    sizes = {"L": 2, "B": 3, "H": 4, "N": 5, "C": 6}
    assert layout_strides("LBHNC", sizes) == {"C": 1, "N": 6, "H": 30, "B": 120, "L": 360}
    assert layout_strides("BLNHC", sizes) == {"C": 1, "H": 6, "N": 24, "L": 120, "B": 240}


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_layouts_without_dense_blocks_are_refused_naming_the_layout(layout: str) -> None:
    parts, lay = _native(layout)
    with pytest.raises(LayoutError, match=layout) as info:
        tensor_geometry(NAMES[0], parts[NAMES[0]][0], B, lay)
    assert "kv_cache_layout" in str(info.value) and "dense" in str(info.value)


def test_one_head_views_keep_their_order_and_lhbnc_is_dense_then() -> None:
    """MLA (one head): vLLM's strides still tell the order; with heads outside blocks, LHBNC is dense."""
    for layout, head_major in (("LBHNC", True), ("LBNHC", False), ("LHBNC", False)):
        parts, lay = _native(layout, heads=1, dims=(D, D // 8))
        g = tensor_geometry(NAMES[1], parts[NAMES[1]][0], B, lay)
        assert (g.heads, g.head_major, g.stride, g.head_bytes) == (1, head_major, g.block_len, (D + D // 8) * 2)
    one_head_hnd = build_attention_caches("legacy-HND", NAMES[:1], blocks=B, tokens=N, heads=1, dims=(D, D))
    parts, lay = label_kv_caches(one_head_hnd.raw)
    assert [tensor_geometry(NAMES[0], t, B, lay).head_major for t in parts[NAMES[0]]] == [True, True]
    assert not tensor_geometry("x", torch.zeros(B, N, 1, D), B).head_major  # vllm-ascend's one-head tuple


@pytest.mark.parametrize(("layout", "head_major"), [("legacy-NHD", False), ("legacy-HND", True), ("", False)])
def test_split_kv_forms(layout: str, head_major: bool) -> None:
    built = build_attention_caches(layout, NAMES, blocks=B, tokens=N, heads=H, dims=(D, D))
    parts, lay = label_kv_caches(built.raw, native=True, layout_name="LBHNC")
    assert lay.name == ""  # no vLLM view among them: the label comes from the strides
    geoms = [tensor_geometry(n, t, B, lay) for n in NAMES for t in parts[n]]
    assert len(geoms) == 2 * len(NAMES) and {g.head_major for g in geoms} == {head_major}
    assert {(g.tokens, g.heads, g.head_bytes) for g in geoms} == {(N, H, D * 2)}
    assert layout_label(lay, geoms) == ("HND" if head_major else "NHD")
    if layout.startswith("legacy"):  # K and V halves of one [2, B, ...] tensor
        assert parts[NAMES[0]][1].data_ptr() - parts[NAMES[0]][0].data_ptr() == B * H * N * D * 2


def test_mla_3d_and_kernel_blocks() -> None:
    mla = torch.zeros(B, N, 72, dtype=torch.float16)
    g = tensor_geometry("mla", mla, B)
    assert (g.tokens, g.heads, g.head_bytes, g.head_major) == (N, 1, 144, False)
    kernel = build_attention_caches("LBHNC", NAMES[:1], blocks=2 * B, tokens=N // 2, heads=H, dims=(D, D))
    parts, lay = label_kv_caches(kernel.raw, native=True, layout_name="LBHNC")
    g = tensor_geometry(NAMES[0], parts[NAMES[0]][0], B, lay)  # 2 kernel blocks per logical block
    assert (g.tokens, g.head_major, g.stride) == (N // 2, True, g.block_len)


def test_unservable_strides_are_refused() -> None:
    content_strided = torch.zeros(B, N, H, 2 * D)[..., ::2]
    with pytest.raises(LayoutError, match="content innermost"):
        tensor_geometry("x", content_strided, B)
    overlapping = torch.zeros(B * N * H * D).as_strided((B, N, H, D), (D, H * D, D, 1))  # blocks share bytes
    with pytest.raises(LayoutError, match="block stride"):
        tensor_geometry("x", overlapping, B)
    with pytest.raises(LayoutError, match="num_blocks"):
        tensor_geometry("x", torch.zeros(B, N, H, D), 4)
    with pytest.raises(LayoutError, match="axes"):
        block_geometry("x", axes="NHD", shape=(1, 2, 3), strides=(6, 3, 1), element_size=2, base=0, num_blocks=1)


def test_token_rows_index_every_form_as_blocks_tokens_heads() -> None:
    parts, _ = _native("LBHNC")
    t = parts[NAMES[0]][0]
    rows = token_rows(t, "BHNC")
    rows[2, 5, 1] = 7
    assert int(t[2, 1, 5].sum()) == 7 * 2 * D
    assert token_rows(torch.zeros(B, N, 8), "BND").shape == (B, N, 1, 8)


# ---- head-major descriptors, byte for byte ---------------------------------------------------------


def _head_major_rank(mem: np.ndarray, offset: int, heads: list[int], blocks: int, seed: int) -> TensorGeom:
    """One rank's head-major cache at ``offset`` of ``mem``: block b, global head h, token t, byte c."""
    hb = 4
    view = mem[offset : offset + blocks * len(heads) * N * hb].reshape(blocks, len(heads), N, hb)
    b, h, t, c = np.meshgrid(np.arange(blocks), np.array(heads), np.arange(N), np.arange(hb), indexing="ij")
    view[...] = (seed * 7 + b * 31 + h * 17 + t * 5 + c) % 251
    return TensorGeom(offset, len(heads) * N * hb, len(heads) * N * hb, N, len(heads), hb, head_major=True)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 4)])
def test_head_major_pulls_write_d_blocks_in_final_order(p_tp: int, d_tp: int) -> None:
    heads, blocks = 4, 5
    mem = np.zeros(1 << 16, dtype=np.uint8)
    p_geoms = [
        _head_major_rank(mem, 0x1000 * (p + 1), list(range(p * heads // p_tp, (p + 1) * heads // p_tp)), blocks, 1)
        for p in range(p_tp)
    ]
    d_heads = heads // d_tp
    for d in range(d_tp):
        d_base = 0x8000 + 0x1000 * d
        ref_mem = np.zeros_like(mem)  # what D's blocks must hold: the same pattern over D's heads
        ref = _head_major_rank(ref_mem, 0, list(range(d * d_heads, (d + 1) * d_heads)), blocks, 1)
        local = TensorGeom(d_base, ref.block_len, ref.block_len, N, d_heads, 4, head_major=True)
        slices = select_sources(d, p_tp, d_tp, heads, "req")
        for p in sorted({s.p_rank for s in slices}):
            desc = build_pull_descriptors([local], [p_geoms[p]], [1, 3], [4, 0], slices=slices, p_rank=p)
            if p_tp < d_tp:
                assert len(desc) == 2  # one piece per block, not one per token row
            for lo, ro, n in zip(desc.local.tolist(), desc.remote.tolist(), desc.lengths.tolist(), strict=True):
                mem[lo : lo + n] = mem[ro : ro + n]
        got = mem[d_base : d_base + blocks * ref.block_len].reshape(blocks, -1)
        expect = ref_mem[: blocks * ref.block_len].reshape(blocks, -1)
        assert (got[1] == expect[4]).all() and (got[3] == expect[0]).all()  # D block 1 <- P block 4, 3 <- 0
        assert not got[[0, 2, 4]].any()  # nothing else written


def test_block_orders_must_match() -> None:
    token = TensorGeom(0, 64, 64, 4, 2, 8)
    head = TensorGeom(0x1000, 64, 64, 4, 2, 8, head_major=True)
    with pytest.raises(LayoutError, match="block order"):
        build_pull_descriptors([token], [head], [1], [1], slices=[HeadSlice(0, 0, 0, 2)], p_rank=0)
