"""A tiny Llama with real random weights, written as safetensors: the engine tier's model.

Runs in: the engine environment (needs torch and transformers).

vLLM's ``load_format="dummy"`` fills weights uniformly in +-1e-3: the logits come out nearly
uniform and the output barely depends on the KV cache, so an identity check on it cannot fail. These
weights are normal with a scale that keeps attention sharp, seeded so that two folders written with
the same seed hold the same model, and with another seed a different one under the same layout.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_LLAMA", "write_tiny_llama"]

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


def write_tiny_llama(path: str | Path, seed: int, *, num_layers: int = 4) -> Path:
    """Write the model into ``path`` (created) and return it.

    Args:
        path: The folder; its basename is the model name engines report.
        seed: Seed of the weights: the same seed writes the same bytes.
        num_layers: Decoder layers.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(num_hidden_layers=num_layers, dtype="float32", **TINY_LLAMA)
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for _name, param in sorted(model.named_parameters()):  # sorted: the same order every run
            if param.dim() == 1:  # norm weights around 1, so activations keep their scale
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(out, safe_serialization=True)
    return out
