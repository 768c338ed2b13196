"""vLLM adapter, configuration side: the instance's `PoolSpec` from vLLM's configs.

Runs in: the vLLM scheduler process and every worker process (called by `AscendStoreConnector`, so
both roles derive identical key layouts). Imports vllm (an adapter module).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_store.assembly import PoolSpec
from ascend_dist.kv_store.config.config import PoolConfig
from ascend_dist.kv_store.config.sizes import pp_layer_partition
from ascend_dist.kv_store.keys.keys import RankPosition, rank_position

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["pool_spec_from_vllm", "rank_position_from_vllm", "retention_interval"]


def _group_rule(spec: object) -> tuple[str, int]:
    """(kind, window) of a group's KV-cache spec: full, sliding_window or mamba (its spec blocks)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs) and spec.kv_cache_specs:
        spec = next(iter(spec.kv_cache_specs.values()))
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window", int(spec.sliding_window)
    if isinstance(spec, MambaSpec):
        return "mamba", int(spec.num_speculative_blocks)
    return "full", 0


def retention_interval(env: Mapping[str, str]) -> int | None:
    """The pool's retention interval: ``VLLM_PREFIX_CACHE_RETENTION_INTERVAL``; unset = dense.

    Deliberately not vLLM 0.33's ``cache_config.prefix_cache_retention_interval``: that one governs
    the local HBM cache and defaults to 0 (boundaries only), which would make the shared pool keep
    no sliding-window or Mamba chunk a partial-prefix hit could use.

    Raises:
        ConfigError: The variable is set to something other than a non-negative integer.
    """
    raw = env.get("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", raw, "a non-negative integer of tokens, or unset")
    return int(raw)


def _group_ranks() -> RankPosition | None:
    """This worker's ranks from vLLM's initialised model-parallel groups; None where there are none (scheduler)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    pcp_group = getattr(ps, "get_pcp_group", None)  # vLLM 0.32 has no PCP
    return RankPosition(
        tp_rank=ps.get_tp_group().rank_in_group,
        pcp_rank=pcp_group().rank_in_group if pcp_group is not None else 0,
        dcp_rank=ps.get_dcp_group().rank_in_group,
        pp_rank=ps.get_pp_group().rank_in_group,
    )


def rank_position_from_vllm(
    vllm_config: VllmConfig, groups: Callable[[], RankPosition | None] = _group_ranks
) -> RankPosition:
    """This worker's TP, PCP, DCP and PP ranks (`rank_position` of ``parallel_config.rank``).

    Where vLLM's model-parallel groups exist (a worker after ``initialize_model_parallel``), they
    must agree: a vLLM that laid its ranks out differently would otherwise key every rank wrong.

    Raises:
        ConfigError: The derived ranks differ from vLLM's groups, or the sizes are inconsistent.
    """
    par = vllm_config.parallel_config
    pos = rank_position(
        par.rank,
        tp_size=par.tensor_parallel_size,
        pp_size=par.pipeline_parallel_size,
        pcp_size=getattr(par, "prefill_context_parallel_size", 1),  # vLLM 0.32 has no PCP
        dcp_size=par.decode_context_parallel_size,
    )
    actual = groups()
    if actual is not None and actual != pos:
        raise ConfigError("parallel_config.rank", par.rank, f"ranks matching vLLM's groups {actual} (derived {pos})")
    return pos


def pool_spec_from_vllm(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, config: PoolConfig | None = None
) -> PoolSpec:
    """Derive the instance's `PoolSpec` from vLLM's configs (identical on scheduler and workers).

    ``config`` adds the P/D layout keys: the peer's TP (``prefill_tp_size`` on a consumer,
    ``decode_tp_size`` otherwise) and, on a consumer, the prefill's PP stages to key chunks for.
    """
    cfg = config or PoolConfig()
    par = vllm_config.parallel_config
    model = vllm_config.model_config
    groups = list(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else []
    block_sizes = tuple(int(g.kv_cache_spec.block_size) for g in groups) or (int(vllm_config.cache_config.block_size),)
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    pos = rank_position_from_vllm(vllm_config)
    pmu = getattr(vllm_config.cache_config, "prefix_match_unit", None)
    rules = [_group_rule(g.kv_cache_spec) for g in groups]
    hybrid = any(kind != "full" for kind, _ in rules)
    spec_cfg = vllm_config.speculative_config
    eagle = bool(spec_cfg is not None and spec_cfg.use_eagle_block_drop())
    stages: tuple[int, ...] = ()
    if pp > 1:
        from vllm.distributed.utils import get_pp_indices

        total = int(model.hf_text_config.num_hidden_layers)
        stages = tuple(end - start for start, end in (get_pp_indices(total, r, pp) for r in range(pp)))
    retention = retention_interval(os.environ)
    rekey: tuple[int, ...] = ()
    if cfg.is_consumer and cfg.prefill_pp_size > 1:
        total = int(model.hf_text_config.num_hidden_layers)
        rekey = tuple(pp_layer_partition(total, cfg.prefill_pp_size, cfg.prefill_pp_layer_partition))
    return PoolSpec(
        model=str(model.model),
        block_sizes=block_sizes,
        num_kv_heads=int(model.get_total_num_kv_heads()),
        use_mla=bool(model.use_mla),
        tp_size=tp,
        tp_rank=pos.tp_rank,
        pp_size=pp,
        pp_rank=pos.pp_rank,
        pcp_size=getattr(par, "prefill_context_parallel_size", 1),
        pcp_rank=pos.pcp_rank,
        dcp_size=par.decode_context_parallel_size,
        dcp_rank=pos.dcp_rank,
        dp_rank=par.data_parallel_rank,
        prefix_match_unit=pmu if isinstance(pmu, int) else None,
        layout_tag=str(vllm_config.cache_config.cache_dtype),
        stage_layers=stages,
        group_kinds=tuple(kind for kind, _ in rules) if hybrid else (),
        sliding_windows=tuple(window if kind == "sliding_window" else 0 for kind, window in rules) if hybrid else (),
        mamba_spec_blocks=max((n for kind, n in rules if kind == "mamba"), default=0),
        use_eagle=eagle,
        retention_interval=retention if hybrid else None,
        peer_tp_size=cfg.peer_tp_size,
        rekey_pp_parts=rekey,
    )
