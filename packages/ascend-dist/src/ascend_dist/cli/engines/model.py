"""A tiny Llama with real random weights, written as safetensors: the engine tier's model.

Runs in: the engine environment (needs torch and transformers).

vLLM's ``load_format="dummy"`` fills weights uniformly in +-1e-3: the logits come out nearly
uniform and the output barely depends on the KV cache, so an identity check on it cannot fail. These
weights are normal with a scale that keeps attention sharp, seeded so that two folders written with
the same seed hold the same model, and with another seed a different one under the same layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TINY_LLAMA", "TINY_QWEN3_NEXT", "write_model", "write_tiny_llama"]

# 2 KV heads (so TP 2 splits them), head size 32 (CPU attention supports 32..512).
TINY_LLAMA = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


# A hybrid model: three Gated DeltaNet (linear attention, with conv and recurrent state) layers and
# one full-attention layer. vLLM's CPU build runs its GDN state in bfloat16 and with head size 128.
TINY_QWEN3_NEXT = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "full_attention_interval": 4,
    "max_position_embeddings": 4096,
}


def write_model(
    path: str | Path,
    seed: int,
    *,
    architecture: str = "llama",
    num_layers: int = 4,
    redraw: str = "",
    redraw_seed: int = 0,
) -> Path:
    """Write ``architecture`` (``llama``, or the hybrid ``qwen3_next``) with seeded weights into ``path``.

    ``redraw``: parameters whose names start with it are drawn again from ``redraw_seed`` (the
    others are ``seed``'s): a model that differs from ``seed``'s only there, e.g. only in one
    layer's attention.
    """
    if architecture == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(num_hidden_layers=4, dtype="bfloat16", **TINY_QWEN3_NEXT)
        return _save(Qwen3NextForCausalLM(config), Path(path), seed, scale=0.05, redraw=(redraw, redraw_seed))
    return write_tiny_llama(path, seed, num_layers=num_layers, redraw=(redraw, redraw_seed))


def write_tiny_llama(path: str | Path, seed: int, *, num_layers: int = 4, redraw: tuple[str, int] = ("", 0)) -> Path:
    """Write the model into ``path`` (created) and return it.

    Args:
        path: The folder; its basename is the model name engines report.
        seed: Seed of the weights: the same seed writes the same bytes.
        num_layers: Decoder layers.
        redraw: ``(name prefix, seed)``: those parameters drawn from that seed (see `write_model`).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=num_layers, dtype="float32", **TINY_LLAMA)
    return _save(LlamaForCausalLM(config), Path(path), seed, scale=0.08, redraw=redraw)


def _save(model: Any, out: Path, seed: int, *, scale: float, redraw: tuple[str, int] = ("", 0)) -> Path:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    params = sorted(model.named_parameters())  # sorted: the same order every run
    prefix, other_seed = redraw
    draws = [(seed, params)]
    if prefix:  # after the whole draw, so every other parameter is exactly seed's
        chosen = [(n, p) for n, p in params if n.startswith(prefix)]
        if not chosen:
            raise ValueError(f"redraw: no parameter starts with {prefix!r}")
        draws.append((other_seed, chosen))
    with torch.no_grad():
        for draw_seed, chosen in draws:
            generator = torch.Generator().manual_seed(draw_seed)
            for _name, param in chosen:
                if param.dim() == 1:  # norm weights around 1, so activations keep their scale
                    param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
                else:
                    param.copy_(scale * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m ascend_dist.cli.engines.model PATH --seed N``: write the tiny Llama into PATH."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny Llama with seeded random weights.")
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    print(write_tiny_llama(args.path, args.seed, num_layers=args.layers))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
