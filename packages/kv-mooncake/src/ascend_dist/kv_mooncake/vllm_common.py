"""vLLM glue shared by the three adapters (`vllm_connector`, `layerwise.vllm_connector`, `sfa.vllm_connector`).

Runs in: vLLM's scheduler and worker processes. An adapter module (it imports vLLM and torch): it
reads the ``kv_transfer_config`` into a connector's config, finds this worker's parallel ranks,
splits vLLM's per-layer caches into the tensors the workers register, and applies one rule to how
D's failed loads reach vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ascend_dist.common.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["block_load_errors", "connector_config", "parallel_ranks", "split_kv_caches", "transfer_results"]

ConfigT = TypeVar("ConfigT")


def connector_config(vllm_config: VllmConfig, connector: str, parse: Callable[..., ConfigT]) -> ConfigT:
    """Parse the ``kv_transfer_config`` with a config's ``from_kv_transfer_config``.

    ``dp_rank`` defaults to vLLM's data-parallel rank; ``dtype`` is the cache dtype, or the
    model's when it is ``auto``.

    Raises:
        ConfigError: The ``kv_transfer_config`` is missing or invalid; the error names the field.
    """
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ConfigError("kv_transfer_config", None, f"set ({connector} needs kv_role, kv_port, engine_id)")
    extra = dict(ktc.kv_connector_extra_config or {})
    extra.setdefault("dp_rank", vllm_config.parallel_config.data_parallel_rank)
    cache_dtype = vllm_config.cache_config.cache_dtype
    return parse(
        engine_id=ktc.engine_id,
        kv_role=ktc.kv_role,
        kv_port=ktc.kv_port,
        extra=extra,
        model=str(vllm_config.model_config.model),
        dtype=str(cache_dtype if cache_dtype != "auto" else vllm_config.model_config.dtype),
    )


def parallel_ranks() -> tuple[int, int, int]:
    """``(tp_rank, pp_rank, pcp_rank)`` of this worker; zeros when vLLM's parallel groups are not initialised."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 0, 0
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pp_group().rank_in_group,
        parallel_state.get_pcp_group().rank_in_group,
    )


def split_kv_caches(kv_caches: Mapping[str, Any]) -> dict[str, list[torch.Tensor]]:
    """Split vLLM's layer -> cache dict into a list of tensors per layer.

    A ``[2, blocks, ...]`` tensor is split into K and V, any other tensor (MLA) kept whole, and a
    list (e.g. Mamba's conv and SSM states) taken as it is.
    """
    parts: dict[str, list[torch.Tensor]] = {}
    for name, t in kv_caches.items():
        if isinstance(t, torch.Tensor) and t.dim() == 5 and t.shape[0] == 2:
            parts[name] = [t[0], t[1]]
        else:
            parts[name] = [t] if isinstance(t, torch.Tensor) else list(t)
    return parts


# How D's failed loads reach vLLM 0.33. Block ids repeat across KV-cache groups, so for a model with
# several groups vLLM raises on block-level reports and wants failed requests instead; with one
# group block ids say more (vLLM recomputes from the first bad block, not from the start).


def transfer_results(
    sending: set[str] | None, recving: set[str] | None, failed: set[str], num_groups: int
) -> KVConnectorTransferResults:
    """VLLM's per-step report: ``failed`` (already in ``recving``) is passed on only with several groups."""
    return KVConnectorTransferResults(
        finished_sending=set(sending or ()),
        finished_recving=set(recving or ()),
        failed_recving=failed if num_groups > 1 else set(),
    )


def block_load_errors(errors: set[int], num_groups: int) -> set[int]:
    """The failed block ids vLLM may be given: all of them with one group, none with several."""
    return errors if num_groups == 1 else set()
