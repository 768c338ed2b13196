"""One rank of the vLLM process-group test: `python vllm_groups_worker.py RANK WORLD PORT`.

Brings up vLLM's own distributed environment over gloo on the CPU, then creates the Ascend groups
through vLLM's real `init_model_parallel_group` and prints what this rank's coordinators saw.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

from ascend_dist.parallel.groups import AscendGroupOptions
from ascend_dist.parallel.vllm_groups import (
    ASCEND_GROUPS,
    destroy_ascend_model_parallel,
    get_worker_global_rank,
    init_ascend_model_parallel,
)


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    parallel = ParallelConfig(tensor_parallel_size=world)
    with set_current_vllm_config(VllmConfig(parallel_config=parallel, device_config=DeviceConfig("cpu"))):
        init_distributed_environment(
            world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank,
            backend="gloo",
        )  # fmt: skip
        ensure_model_parallel_initialized(world, 1, backend="gloo")
        options = AscendGroupOptions(pd_tp_ratio=2, pd_head_ratio=2, is_kv_producer=True, oproj_tp_size=1)
        groups = init_ascend_model_parallel(options)
        mc2, p_tp = groups.get("mc2"), groups.get("p_tp")
        total = torch.tensor([float(rank)])
        mc2.all_reduce(total)  # type: ignore[attr-defined]
        seen = {
            "rank": rank,
            "mc2_size": mc2.world_size,  # type: ignore[attr-defined]
            "p_tp_ranks": p_tp.ranks,  # type: ignore[attr-defined]
            "sum": total.item(),
            "global_rank": get_worker_global_rank(),
        }
        destroy_ascend_model_parallel()
        seen["destroyed"] = not ASCEND_GROUPS.initialized
        print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
