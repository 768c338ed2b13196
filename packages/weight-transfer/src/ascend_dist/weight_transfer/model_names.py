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

`mismatches` checks shapes and dtypes where vLLM's loaders would copy as they are: a tensor that
reaches a parameter with the plain loader (no ``weight_loader``, or vLLM's ``default_weight_loader``)
must have its shape (one element fits a 0-dim parameter); one that reaches a TP-sharded linear
parameter (``output_dim`` / ``input_dim``) must have its rank and the size of every unsharded dim
(the sharded ones carry the trainer's full size, or a padded vocabulary). Parameters with a loader
of their own that reshapes, packed quantised ones (``packed_dim``) and every linear parameter of a
quantised model (``quant_config``: kernel layouts differ from the checkpoint's) are left to their
loaders. Both sides must be floating point or both not: ``copy_`` would cast silently.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["mismatches", "unknown_names"]


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


def _candidates(name: str, mapper: Any, packed: Mapping[str, Sequence[str]]) -> tuple[list[str], list[str]] | None:
    """Direct names ``name`` may load into, and names through the packed mapping; None when skipped on purpose."""
    mapped = _mapped(mapper, name)
    if mapped is None or any(marker in name for marker in _SKIPPED):
        return None
    direct = [*mapped, name]
    return direct, [p for c in direct for p in _packed(c, packed)]


def _shape_problem(target: torch.Tensor, shape: tuple[int, ...], via_packing: bool, quantised: bool) -> str:
    """Why a checkpoint tensor of ``shape`` cannot go into ``target`` as vLLM's loaders copy, or ""."""
    loader = getattr(target, "weight_loader", None)
    sharded = {d for d in (getattr(target, "output_dim", None), getattr(target, "input_dim", None)) if d is not None}
    if loader is None or getattr(loader, "__name__", "") == "default_weight_loader":
        if sharded or via_packing:
            pass  # a linear parameter's attributes on the plain loader: check it as one below
        elif tuple(target.shape) != shape and not (target.numel() == 1 and math.prod(shape) == 1):
            return f"shape {shape} does not fit the model's {tuple(target.shape)}"
        else:
            return ""
    if not sharded or quantised or hasattr(target, "packed_dim"):
        return ""  # a loader of its own decides
    if len(shape) != target.dim():
        return f"shape {shape} has {len(shape)} dims, the model's {tuple(target.shape)} has {target.dim()}"
    for dim, (mine, theirs) in enumerate(zip(target.shape, shape, strict=True)):
        if dim not in sharded and mine != theirs:
            return f"shape {shape} differs from the model's {tuple(target.shape)} in dim {dim} (not a sharded dim)"
    return ""


def mismatches(model: torch.nn.Module, specs: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[str]:
    """Why tensors ``(name, dtype name, shape)`` cannot be loaded into ``model`` as they are, one line each, in order.

    Names the model has no tensor for are not reported here (`unknown_names` does).
    """
    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    targets.update(model.named_buffers(remove_duplicate=False))
    packed: Mapping[str, Sequence[str]] = getattr(model, "packed_modules_mapping", None) or {}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    quantised = getattr(model, "quant_config", None) is not None
    found = []
    for name, dtype_name, shape in specs:
        candidates = _candidates(name, mapper, packed)
        if candidates is None:
            continue
        direct, through_packing = candidates
        hit = next((c for c in direct if c in targets), None)
        via_packing = hit is None
        hit = hit or next((c for c in through_packing if c in targets), None)
        if hit is None:
            continue
        target = targets[hit]
        if target.numel() == 0:
            # A placeholder, not the weight's shape: vLLM's CPU build moves a linear weight into a
            # packed GEMM handle after loading and leaves an empty (0,) tensor; its loader decides.
            continue
        problem = _shape_problem(target, tuple(shape), via_packing, quantised)
        dtype = getattr(torch, dtype_name, None)
        if not problem and isinstance(dtype, torch.dtype) and dtype.is_floating_point != target.is_floating_point():
            problem = f"dtype {dtype_name} into the model's {str(target.dtype).removeprefix('torch.')} would be cast"
        if problem:
            found.append(f"tensor {name!r}{f' (-> {hit})' if hit != name else ''}: {problem}")
    return found


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
