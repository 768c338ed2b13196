"""vLLM glue shared by the three adapters (`vllm_connector`, `layerwise.vllm_connector`, `sfa.vllm_connector`).

Runs in: vLLM's scheduler and worker processes. An adapter module (it imports vLLM and torch): it
reads the ``kv_transfer_config`` into a connector's config, finds this worker's parallel ranks,
splits vLLM's per-layer caches into the tensors the workers register (labelled with their logical
axes and vLLM's resolved KV-cache layout, `read_kv_caches`), and applies one rule to how D's
failed loads reach vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.kv_geometry import CacheLayout
from ascend_dist.kv_mooncake.kv_views import label_kv_caches

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "block_load_errors",
    "connector_config",
    "kv_cache_layout_name",
    "model_name",
    "parallel_ranks",
    "read_kv_caches",
    "split_kv_caches",
    "transfer_results",
]

logger = logging.getLogger(__name__)

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
        model=model_name(vllm_config),
        dtype=str(cache_dtype if cache_dtype != "auto" else vllm_config.model_config.dtype),
    )


def model_name(vllm_config: VllmConfig) -> str:
    """The model's name as P and D compare it at the handshake: the served name, else the model.

    A local path counts by its last component: P and D on different machines mount the same
    checkpoint at different paths, and what must match is the model, not the mount point.
    """
    model = vllm_config.model_config
    served = getattr(model, "served_model_name", None)
    name = str((served[0] if isinstance(served, list | tuple) and served else served) or model.model)
    return PurePath(name).name if name.startswith(("/", ".")) else name


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


def _native_views() -> bool:
    """Whether this vLLM hands connectors its own ``[B, H, N, C]`` per-layer views (vLLM >= 0.32)."""
    try:
        return importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None
    except (ImportError, ValueError):
        return False


def kv_cache_layout_name(vllm_config: VllmConfig) -> str:
    """VLLM's resolved physical KV-cache layout (``"LBHNC"``, ...); ``""`` before vLLM 0.32 or unresolved."""
    name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    return str(name) if name else ""


def read_kv_caches(
    kv_caches: Mapping[str, Any], vllm_config: VllmConfig
) -> tuple[dict[str, list[torch.Tensor]], CacheLayout]:
    """Split vLLM's layer -> cache dict into tensors per layer, labelled with their logical axes.

    vLLM >= 0.32 hands one ``[B, H, N, C]`` view per attention layer (physical order: the
    resolved ``cache_config.kv_cache_layout``); a legacy ``[2, blocks, ...]`` tensor is split into
    K and V (``[B, N, H, D]``, any stride order); tuples (vllm-ascend's K/V or nope/rope, Mamba's
    states) are taken as they are (see `kv_views.label_kv_caches`). The workers then read each
    tensor's block geometry from its strides.
    """
    native = _native_views()
    parts, layout = label_kv_caches(kv_caches, native=native, layout_name=kv_cache_layout_name(vllm_config))
    logger.info("KV caches of %d layers, layout %s", len(parts), layout.name or "from strides")
    return parts, layout


def split_kv_caches(kv_caches: Mapping[str, Any]) -> dict[str, list[torch.Tensor]]:
    """`read_kv_caches` without vLLM's layout: legacy ``[2, blocks, ...]`` split, everything else as given."""
    return label_kv_caches(kv_caches)[0]


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
