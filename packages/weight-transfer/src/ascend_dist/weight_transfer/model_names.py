"""Which tensor names of an update a vLLM model can load, checked before the commit vote.

Runs in: vLLM worker processes (imports torch only).

vLLM's ``load_weights`` raises on an unknown name only while loading, after every rank voted to
commit, so one bad name left layers half-written (or on the meta device in a layer-wise reload).
This check runs at the vote instead: a name is loadable when it is a parameter or buffer of the
model, directly, through the model's ``hf_to_vllm_mapper`` (a name it maps to nothing is dropped on
purpose and accepted), or through its ``packed_modules_mapping`` (``q_proj`` -> ``qkv_proj``), or
when it addresses a fused-experts module (``...experts.<n>...`` under an ``experts`` module) or a
layer another pipeline stage holds (``PPMissingLayer``); rotary caches are skipped as vLLM's
loaders do. A model whose loader renames in other ways turns the check off with
``validate_names=False``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["unknown_names"]


_SKIPPED = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
"""Checkpoint tensors vLLM's loaders skip by name (rotary caches some checkpoints carry)."""


def _mapped(mapper: Any, name: str) -> list[str] | None:  # mapper: vLLM's WeightsMapper
    """Names ``mapper`` turns ``name`` into; None when it drops the name on purpose."""
    if mapper is None or not hasattr(mapper, "apply_list"):
        return [name]
    out = list(mapper.apply_list([name]))
    return out or None


def _packed(name: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """``name`` with a packed part (``.q_proj.``) renamed to its packed module (``.qkv_proj.``)."""
    out = []
    for packed_name, parts in packed.items():
        for part in parts:
            marker = f".{part}."
            if marker in f".{name}":
                out.append(f".{name}".replace(marker, f".{packed_name}.", 1)[1:])
    return out


def unknown_names(model: torch.nn.Module, names: Iterable[str]) -> list[str]:
    """The names in ``names`` that ``model`` has no parameter, buffer or fused module for, in order."""
    # vLLM puts a PPMissingLayer where another pipeline stage holds the layer: its loader skips those names
    missing = tuple(f"{n}." for n, m in model.named_modules() if type(m).__name__ == "PPMissingLayer")
    tensors = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tensors |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    modules = {n for n, _ in model.named_modules(remove_duplicate=False)}
    packed: Mapping[str, Sequence[str]] = getattr(model, "packed_modules_mapping", None) or {}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    unknown = []
    for name in names:
        mapped = _mapped(mapper, name)
        if mapped is None or any(marker in name for marker in _SKIPPED):
            continue  # the model's mapper drops it, or vLLM's loaders skip it: not an error
        candidates = [*mapped, name]
        candidates += [p for c in list(candidates) for p in _packed(c, packed)]
        if any(c in tensors for c in candidates):
            continue
        if missing and any(c.startswith(missing) for c in candidates):
            continue
        if any(".experts." in c and c.split(".experts.", 1)[0] + ".experts" in modules for c in candidates):
            continue
        unknown.append(name)
    return unknown
