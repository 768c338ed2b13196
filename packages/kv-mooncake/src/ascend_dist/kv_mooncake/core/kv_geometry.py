"""A KV tensor's block geometry, read from its strides instead of assumed from its shape.

Runs in: worker processes, at ``register_kv_caches`` (all three connectors). Pure: shapes,
strides and ints in, `TensorGeom` out; no torch.

Engines hand the connector KV tensors in several forms; each is labelled with its **logical**
axes by the adapter glue (`ascend_dist.kv_mooncake.core.kv_views`), and the physical order comes from
the strides alone:

| form | logical axes | label |
|---|---|---|
| vLLM >= 0.32, one view per attention layer (K and V fused in ``C``; MLA: ``H = 1``) | ``[B, H, N, C]`` | ``BHNC`` |
| vllm-ascend's tuple (K, V) / (nope, rope); each half of a legacy ``[2, B, N, H, D]`` | ``[B, N, H, D]`` | ``BNHD`` |
| a 3-D MLA tensor | ``[B, N, D]`` | ``BND`` |

``B`` counts kernel blocks (``num_blocks`` times the kernel ratio), ``N`` tokens per kernel
block, ``H`` this rank's KV heads, ``C``/``D`` the content of one head of one token. A tensor the
connector can serve has its content innermost and contiguous, each block dense in one of two
orders (token-major ``[N][H][C]``: NHD, vllm-ascend, FlashAttention, vLLM ``LBNHC``/``BLNHC``;
head-major ``[H][N][C]``: HND, vLLM's CPU attention and FlashInfer, ``LBHNC``/``BLHNC``) and a
block stride of at least one block (block-outermost layouts put the other layers' pages between
a layer's blocks). Anything else (vLLM ``LHBNC``: heads outside blocks, so a block is not one run)
is refused with a `LayoutError` naming the layout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ascend_dist.common.errors import LayoutError
from ascend_dist.kv_mooncake.core.blocks import TensorGeom

__all__ = ["AXES", "CacheLayout", "block_geometry", "layout_label"]

AXES = ("BHNC", "BNHD", "BND")
"""The logical axis labels the adapters give a KV tensor (see the module docstring)."""


@dataclass(frozen=True)
class CacheLayout:
    """How the engine laid out its KV tensors: what ``register_kv_caches`` needs to read them.

    Attributes:
        name: The engine's layout name, for errors and the handshake: vLLM's ``KVCacheLayout``
            member (``"LBHNC"``), or ``""`` when the engine does not say (then `layout_label`
            names the order the strides show: ``"NHD"`` or ``"HND"``).
        axes: Layer name -> logical axes of its tensors (one of `AXES`); a layer not listed takes
            ``BND`` for 3-D and ``BNHD`` for 4-D tensors (vllm-ascend's forms).
    """

    name: str = ""
    axes: Mapping[str, str] = field(default_factory=dict)

    def axes_of(self, layer: str, ndim: int) -> str:
        """The logical axes of a ``ndim``-D tensor of ``layer``."""
        return self.axes.get(layer) or ("BND" if ndim == 3 else "BNHD")


def _describe(layout: str, axes: str) -> str:
    return layout or f"{axes} tensor"


def block_geometry(
    name: str,
    *,
    axes: str,
    shape: Sequence[int],
    strides: Sequence[int],
    element_size: int,
    base: int,
    num_blocks: int,
    layout: str = "",
) -> TensorGeom:
    """The geometry of one KV tensor from its logical shape and its strides (in elements).

    Args:
        name: The layer (or tensor) name, for errors.
        axes: Its logical axes, one of `AXES`.
        shape: Its shape in ``axes`` order.
        strides: Its strides in elements, same order.
        element_size: Bytes per element.
        base: Address of block 0.
        num_blocks: Logical blocks; ``shape[B]`` may be a multiple (kernel blocks), and
            the geometry then describes one kernel block.
        layout: The engine's layout name, named in errors.

    Returns:
        The geometry, ``head_major`` set for ``[H][N][C]`` blocks.

    Raises:
        LayoutError: Unknown axes, a rank that does not match them, a block count that is not a
            multiple of ``num_blocks``, or strides the connector cannot serve (naming the layout).
    """
    if axes not in AXES:
        raise LayoutError(f"{name} axes", axes, f"one of {', '.join(AXES)}")
    if len(shape) != len(axes) or len(strides) != len(axes):
        raise LayoutError(f"{name}.shape", tuple(shape), f"{len(axes)} dims [{', '.join(axes)}]")
    size = dict(zip(axes, shape, strict=True))
    step = dict(zip(axes, strides, strict=True))
    blocks, tokens, heads = size["B"], size["N"], size.get("H", 1)
    content = size.get("C", size.get("D", 0))
    c_step = step.get("C", step.get("D", 0))
    if num_blocks <= 0 or blocks % num_blocks:
        raise LayoutError(
            f"{name}.shape[B]", blocks, f"a multiple of num_blocks ({num_blocks}): kernel blocks per logical block"
        )
    has_h = "H" in size
    h_step = step.get("H", content)
    # The strides of a size-1 axis still tell the order when the engine built the view in it
    # (``as_strided``, ``permute``): read them strictly first, leniently only for one head.
    token_major = (tokens == 1 or step["N"] == heads * content) and (not has_h or h_step == content)
    head_major = has_h and h_step == tokens * content and (tokens == 1 or step["N"] == content)
    one_head = heads == 1 and (tokens == 1 or step["N"] == content)
    block_len = tokens * heads * content * element_size
    stride = step["B"] * element_size if blocks > 1 else block_len
    if (content > 1 and c_step != 1) or not (token_major or head_major or one_head) or stride < block_len:
        raise LayoutError(
            f"{name} kv_cache_layout",
            _describe(layout, axes),
            "content innermost and contiguous, each block dense as [tokens][heads][content] or "
            "[heads][tokens][content], block stride >= one block "
            f"(this tensor: shape {tuple(shape)}, strides {tuple(strides)} over [{', '.join(axes)}])",
        )
    return TensorGeom(
        base, block_len, stride, tokens, heads, content * element_size, head_major=head_major and not token_major
    )


def layout_label(layout: CacheLayout, geoms: Iterable[TensorGeom]) -> str:
    """The layout's name as P and D compare it at the handshake.

    The engine's name when it gave one, else the order the strides show (``"NHD"``, ``"HND"``,
    or ``"HND+NHD"`` for a cache mixing both).
    """
    if layout.name:
        return layout.name
    orders = sorted({"HND" if g.head_major else "NHD" for g in geoms})
    return "+".join(orders) or "NHD"
