"""The NCCL dialect on real NVIDIA GPUs (opt-in: ``nox -s device -- -m cuda`` on a CUDA host).

The library is found as vLLM does: ``VLLM_NCCL_SO_PATH``, else ``libnccl.so.2`` (already loaded by
torch's CUDA build, or on the loader path).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ascend_dist.hccl_ctypes import NcclDataType, NcclError, NCCLLibrary, NcclRedOp, Role

pytestmark = pytest.mark.cuda


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA device(s)")


def test_nccl_binding_on_one_gpu() -> None:
    _need_gpus(1)
    lib = NCCLLibrary()
    assert lib.has(Role.ABORT) and lib.has(Role.SEND)
    with torch.cuda.device(0):
        comm = lib.comm_init_rank(1, lib.get_unique_id(), 0)
        stream = torch.cuda.current_stream().cuda_stream
        x = torch.arange(16, dtype=torch.float32, device="cuda:0")
        y = torch.empty_like(x)
        lib.all_reduce(x.data_ptr(), y.data_ptr(), 16, NcclDataType.FLOAT32, NcclRedOp.SUM, comm, stream)
        lib.broadcast(x.data_ptr(), 16, NcclDataType.FLOAT32, 0, comm, stream)
        g = torch.empty(16, device="cuda:0")
        lib.all_gather(x.data_ptr(), g.data_ptr(), 16, NcclDataType.FLOAT32, comm, stream)
        torch.cuda.synchronize()
        assert torch.equal(y, x) and torch.equal(g, x)
        with pytest.raises(NcclError, match="ncclBroadcast failed with code"):
            lib.broadcast(x.data_ptr(), 16, NcclDataType.FLOAT32, 5, comm, stream)  # root outside the group
        lib.comm_destroy(comm)
    assert lib.get_error_string(4)  # the library's own text


def test_communicator_on_two_gpus(run_ranks: Any) -> None:
    _need_gpus(2)
    results = run_ranks("cuda_comm", 2, {"ASCEND_DIST_DEVICE": "cuda"}, timeout=120)
    for rank, res in enumerate(results):
        assert (res["engine"], res["dialect"]) == ("library", "nccl")
        assert res["sum"] == [float(2 * i + 1) for i in range(8)]
        assert res["broadcast"] == [1.0] * 6
        assert res["all_gather"] == [0, 0, 1, 1]
        assert res["reduce_scatter"] == [2 * v for v in range(rank * 3, rank * 3 + 3)]
        assert res["p2p"] == sum(range(100))
        assert res["wrong_device"].startswith("ConfigError::in_tensor.device='cpu'")
