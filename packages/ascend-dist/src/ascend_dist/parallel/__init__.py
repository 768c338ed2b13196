"""Ascend process groups: rank lists from one layout, creation through vLLM, real teardown.

`layout` is pure (numpy); `groups` creates them through an injected factory; `vllm_groups` is the only
module importing vLLM; `dist_utils` holds the small collective helpers.
"""

from ascend_dist.parallel.groups import AscendGroupOptions, AscendProcessGroups, GroupNotInitialized
from ascend_dist.parallel.layout import (
    ParallelLayout,
    compute_finegrained_groups,
    compute_mc2_groups,
    compute_p_tp_groups,
    get_global_rank,
)

__all__ = [
    "AscendGroupOptions",
    "AscendProcessGroups",
    "GroupNotInitialized",
    "ParallelLayout",
    "compute_finegrained_groups",
    "compute_mc2_groups",
    "compute_p_tp_groups",
    "get_global_rank",
]
