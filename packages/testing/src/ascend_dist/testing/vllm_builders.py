"""vLLM builders for the adapter tests: a tiny model directory, configs, block hashers, requests.

`Side` is one instance's scheduler- and worker-role connectors from vLLM's factory.

vLLM and torch are imported inside the functions only: importing this module costs nothing where
vLLM is absent, so a test module can import it before its ``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, cast

NUM_BLOCKS = 32
BLOCK = 16

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "torch_dtype": "float16",
}
"""The tiny Llama's ``config.json`` (no weights: the tests never run the model)."""


def write_model_dir(d: Path, **overrides: Any) -> Path:
    """Write the tiny Llama's ``config.json`` (with ``overrides``) into ``d``; returns ``d``."""
    (d / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return d


def make_vllm_config(
    model_dir: Path,
    *,
    connector: str,
    module: str,
    role: Literal["kv_producer", "kv_consumer", "kv_both"],
    engine_id: str,
    kv_port: int,
    extra: dict[str, Any],
    **cache: Any,
) -> Any:
    """A CPU ``VllmConfig`` with ``connector`` from ``module``, P and D at TP 1 unless ``extra`` says otherwise.

    ``cache`` goes to ``CacheConfig`` (e.g. ``enable_prefix_caching=False``); the pool has
    `NUM_BLOCKS` blocks of `BLOCK` tokens.
    """
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector=connector,
        kv_role=role,
        kv_connector_module_path=module,
        engine_id=engine_id,
        kv_port=kv_port,
        kv_connector_extra_config={"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, **extra},
    )
    return cpu_vllm_config(model_dir, ktc, **cache)


def cpu_vllm_config(model_dir: Path, kv_transfer_config: Any, *, num_blocks: int = NUM_BLOCKS, **cache: Any) -> Any:
    """A CPU ``VllmConfig`` of the model in ``model_dir`` with ``kv_transfer_config`` as given.

    512-token context and batches, 8 sequences, float16; ``cache`` goes to ``CacheConfig``, the
    pool has ``num_blocks`` blocks of `BLOCK` tokens.
    """
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=512),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=512, max_num_seqs=8, max_model_len=512, is_encoder_decoder=False
        ),
        cache_config=CacheConfig(block_size=BLOCK, **cache),
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    return config


def attention_spec(num_kv_heads: int, head_size: int) -> Any:
    """A float16 ``FullAttentionSpec`` of `BLOCK`-token blocks."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float16)


def kv_cache_config(
    groups: Sequence[tuple[Sequence[str], Any]], *, block_stride: bool = True, num_blocks: int = NUM_BLOCKS
) -> Any:
    """A ``KVCacheConfig`` of ``num_blocks`` blocks: one group per ``(layer names, spec)``, one tensor per layer.

    With ``block_stride`` each tensor says its page size as the block stride, else 0.
    """
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    tensors = [
        KVCacheTensor(
            size=spec.page_size_bytes * num_blocks,
            layers=[name],
            layer_stride=0,
            block_stride=spec.page_size_bytes if block_stride else 0,
        )
        for names, spec in groups
        for name in names
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(list(names), spec) for names, spec in groups],
    )


def blocks(*groups: list[int]) -> Any:
    """``KVCacheBlocks`` holding these block ids, one list per KV-cache group."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple([KVCacheBlock(i) for i in ids] for ids in groups))


def block_hasher(config: Any = None, kcc: Any = None) -> Any:
    """The block hasher vLLM's ``EngineCore`` gives every request of ``config`` (which has a KV connector).

    As ``EngineCore.__init__`` builds it: the hash function ``prefix_caching_hash_algo`` names,
    ``init_none_hash`` with it, hashes every hash block vLLM resolves for ``config`` and ``kcc``.
    Without them (``config`` needs ``kcc``): what it resolves for `make_vllm_config` and one group of
    `BLOCK`-token blocks.
    """
    from vllm.config import CacheConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes

    cache = config.cache_config if config is not None else CacheConfig(block_size=BLOCK)
    hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hash_block = BLOCK if config is None else resolve_kv_cache_block_sizes(kcc, config)[1]
    # vLLM 0.33 hashes a block with the tokens after it when drafting needs them; 0.32 has no lookahead.
    lookahead = getattr(config, "num_hash_lookahead_tokens", 0)
    if lookahead:
        return get_request_block_hasher(hash_block, hash_fn, lookahead)
    return get_request_block_hasher(hash_block, hash_fn)


def request(rid: str, n: int, params: Any, max_tokens: int = 1, *, first: int = 100, hasher: Any = None) -> Any:
    """A vLLM ``Request`` with prompt ``first..first+n`` carrying ``params`` as its kv_transfer_params.

    Hashed as vLLM's engine hashes it: with ``hasher``, else `block_hasher`'s default.
    """
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(first, first + n)), sampling, None, block_hasher=hasher or block_hasher())


class Side:
    """One instance: scheduler- and worker-role connectors from vLLM's factory, random CPU caches.

    Each layer's cache is ``[2, blocks, block, 2 heads, 16]`` float16 (K and V), as
    `attention_spec(2, 16)` describes.
    """

    def __init__(self, config: Any, seed: int, layers: Sequence[str], kcc: Any, meta_type: type) -> None:
        """Build both roles with ``kcc`` and register the caches (seeded) with the worker."""
        import torch
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.layers = list(layers)
        self.meta_type = meta_type
        self.sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kcc)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
        gen = torch.Generator().manual_seed(seed)
        self.caches = {
            n: torch.randn(2, NUM_BLOCKS, BLOCK, 2, 16, generator=gen).to(torch.float16) for n in self.layers
        }
        self.worker.register_kv_caches(self.caches)

    def run_step(self, out: Any) -> None:
        """Build the scheduler's metadata for ``out`` (checking its type), bind it and start the worker's loads."""
        meta = self.sched.build_connector_meta(out)
        assert isinstance(meta, self.meta_type)
        self.worker.handle_preemptions(meta)  # vLLM's runner calls it first, every step
        self.worker.bind_connector_metadata(meta)
        # Our connectors never read the forward context; the tests have no model to build one from.
        self.worker.start_load_kv(cast("Any", None))

    def block(self, block_id: int) -> bytes:
        """Every layer's K and V bytes of one block."""
        return b"".join(self.caches[n][kv, block_id].numpy().tobytes() for n in self.layers for kv in (0, 1))

    def close(self) -> None:
        """Shut both roles down."""
        self.worker.shutdown()
        self.sched.shutdown()
