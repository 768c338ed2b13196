"""One worker of a vLLM replica for the npu_ipc load vote: `python rank.py RANK TP PP PORT`.

Brings up vLLM's own distributed environment over gloo on the CPU (TP x PP ranks), builds our
`NPUIPCWeightTransferEngine` as vLLM's factory does (no replica exchange given: it uses vLLM's groups),
inits it (every rank together: the vote's store is hosted by rank 0 and found through vLLM's CPU groups),
then votes twice: rank 1 fails the first load, every rank loads the second. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    init_distributed_environment,
)

from ascend_dist.weight_transfer.vllm_engine import NPUIPCWeightTransferEngine, NPUIPCWeightTransferInitInfo


def main() -> None:
    rank, tp, pp, port = (int(a) for a in sys.argv[1:5])
    parallel = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    config = VllmConfig(parallel_config=parallel, device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=tp * pp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank,
            backend="gloo",
        )  # fmt: skip
        ensure_model_parallel_initialized(tp, pp, backend="gloo")
        engine = NPUIPCWeightTransferEngine(
            WeightTransferConfig(backend="npu_ipc"), config, torch.device("cpu"), torch.nn.Linear(2, 2)
        )
        engine.init_transfer_engine(NPUIPCWeightTransferInitInfo(vote_timeout_s=30.0))
        vote = engine.worker.vote
        assert vote is not None, "no load vote on a replica of several ranks"
        failed = vote.vote("0a1b", "loader: KeyError" if rank == 1 else None)
        torch.distributed.barrier()  # vLLM's collective RPC: the next update comes once every rank returned
        loaded = vote.vote("0a1c", None)
        torch.distributed.barrier()
        seen = {
            "rank": rank,
            "vote_rank": vote.rank,
            "world": vote.world_size,
            "first": {"commit": failed.commit, "failures": {str(k): v for k, v in failed.failures.items()}},
            "second": loaded.commit,
        }
        engine.shutdown()
        seen["left"] = engine.worker.vote is None
        destroy_model_parallel()
        destroy_distributed_environment()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
