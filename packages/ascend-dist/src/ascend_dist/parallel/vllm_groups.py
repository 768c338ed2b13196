"""vLLM adapter of the Ascend process groups: the only module here that imports vLLM.

Runs in: every vLLM worker, after `ensure_model_parallel_initialized`. Call `init_ascend_model_parallel`
once, and `destroy_ascend_model_parallel` when the worker tears its groups down (vLLM's own
`destroy_model_parallel` does not know these groups).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from vllm.config import ParallelConfig, get_current_vllm_config
from vllm.distributed.parallel_state import (
    GroupCoordinator,
    get_dcp_group,
    get_world_group,
    init_model_parallel_group,
)

from ascend_dist.parallel.groups import AscendGroupOptions, AscendProcessGroups
from ascend_dist.parallel.layout import ParallelLayout, get_global_rank

__all__ = [
    "ASCEND_GROUPS",
    "destroy_ascend_model_parallel",
    "get_decode_context_model_parallel_rank",
    "get_decode_context_model_parallel_world_size",
    "get_worker_global_rank",
    "init_ascend_model_parallel",
    "layout_of",
]

# The process's groups (vllm-ascend keeps them in module globals; one object here, re-creatable).
ASCEND_GROUPS = AscendProcessGroups()


def layout_of(parallel_config: ParallelConfig, world_size: int) -> ParallelLayout:
    """The rank layout vLLM uses for `parallel_config` in a torch world of `world_size` ranks."""
    return ParallelLayout(
        world_size,
        tp=parallel_config.tensor_parallel_size,
        dp=parallel_config.data_parallel_size,
        pp=parallel_config.pipeline_parallel_size,
        pcp=parallel_config.prefill_context_parallel_size,
    )


def _vllm_factory(group_ranks: list[list[int]], local_rank: int, backend: str, group_name: str) -> GroupCoordinator:
    return init_model_parallel_group(group_ranks, local_rank, backend, group_name=group_name)


def init_ascend_model_parallel(
    options: AscendGroupOptions,
    *,
    parallel_config: ParallelConfig | None = None,
    groups: AscendProcessGroups = ASCEND_GROUPS,
) -> AscendProcessGroups:
    """Create the Ascend groups of this worker from vLLM's world group and parallel config."""
    config = parallel_config or get_current_vllm_config().parallel_config
    world = get_world_group()
    backend = str(dist.get_backend(world.device_group))
    groups.create(
        layout_of(config, dist.get_world_size()),
        options,
        rank=dist.get_rank(),
        local_rank=world.local_rank,
        backend=backend,
        factory=_vllm_factory,
    )
    return groups


def destroy_ascend_model_parallel(groups: AscendProcessGroups = ASCEND_GROUPS) -> None:
    """Destroy every Ascend group; they can be created again afterwards."""
    groups.destroy()


def get_worker_global_rank(parallel_config: ParallelConfig | None = None) -> int:
    """`get_global_rank` for this worker, from vLLM's config and world group."""
    config: Any = parallel_config or get_current_vllm_config().parallel_config
    return get_global_rank(
        tp=config.tensor_parallel_size,
        pp=config.pipeline_parallel_size,
        pcp=config.prefill_context_parallel_size,
        data_parallel_index=config.data_parallel_index,
        rank_in_group=get_world_group().rank_in_group,
    )


def get_decode_context_model_parallel_world_size() -> int:
    """World size of vLLM's DCP group (a helper vLLM main removed)."""
    return get_dcp_group().world_size


def get_decode_context_model_parallel_rank() -> int:
    """This rank's index in vLLM's DCP group."""
    return get_dcp_group().rank_in_group
