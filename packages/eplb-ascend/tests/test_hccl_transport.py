"""Expert weights through the REAL `PyHcclCommunicator` (gloo engine, CPU runtime) across 2 processes."""

import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ascend_dist.common.device import create_runtime
from ascend_dist.common.errors import ConfigError, TransferTimeout
from ascend_dist.eplb_ascend._demo.launch import run_ranks
from ascend_dist.eplb_ascend._demo.worker import build_weights, weights_match
from ascend_dist.eplb_ascend.communicator import ExpertTransferQueue
from ascend_dist.eplb_ascend.controller import EplbRankState
from ascend_dist.eplb_ascend.hccl_transport import hccl_transport
from ascend_dist.eplb_ascend.mover import ExpertWeightMover
from ascend_dist.eplb_ascend.placement import initial_placement
from ascend_dist.eplb_ascend.transport import GlooTransport, P2POperation
from ascend_dist.hccl_ctypes import PyHcclCommunicator

DTYPES = (torch.bfloat16, torch.int8, torch.float16, torch.float32)


def _expert(expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Random bytes of one expert weight, reproducible on any rank."""
    gen = torch.Generator().manual_seed(1000 + expert)
    raw = torch.randint(0, 256, (64 * 4,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(8, -1).clone()


def _rank(cfg):
    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))  # fmt: skip
    rt = create_runtime("cpu")
    try:
        control = GlooTransport()
        group = dist.new_group(backend="gloo")  # the bytes' group: apart from control, as vLLM's EP group is
        comm = PyHcclCommunicator(group, backend="gloo", runtime=rt, init_timeout_s=20, op_timeout_s=10)
        transport = hccl_transport(comm, control)
        peer = 1 - rank
        out = {"rank": rank, "engine": comm.engine}
        # 1. vLLM's add_send/add_recv/execute: every expert dtype, exact bytes
        queue = ExpertTransferQueue(transport, timeout_s=10)
        theirs = [torch.empty_like(_expert(peer, d)) for d in DTYPES]
        queue.add_send([_expert(rank, d) for d in DTYPES], peer, expert_id=rank)
        queue.add_recv(theirs, peer, expert_id=peer)
        queue.execute()
        want = [_expert(peer, d) for d in DTYPES]
        out["queue_bytes_ok"] = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(theirs, want, strict=True)
        )
        # 2. a whole rearrangement through the mover: every slot changes, experts cross ranks
        placement = initial_placement(8, 8, 2)
        local = placement[:, rank * 4 : (rank + 1) * 4]
        state = EplbRankState(placement, num_logical=8, weights=build_weights(local, [[4, 8], [8]]),
                              mover=ExpertWeightMover(transport, timeout_s=10))  # fmt: skip
        stats = state.rearrange(np.roll(placement, 2, axis=1))
        out["rearranged_ok"] = weights_match(state) and stats.bytes_received > 0
        # 3. a peer late past the deadline: TransferTimeout in time; the stream drains once it arrives
        late = torch.empty(16, dtype=torch.int64)
        if rank == 0:
            start = time.monotonic()
            try:
                transport.batch_send_recv([P2POperation("recv", late, 1)], 1.0)
                out["late"] = "no error"
            except TransferTimeout:
                out["late"] = "TransferTimeout"
            out["late_s"] = time.monotonic() - start
            rt.current_stream().synchronize(10)
            out["late_bytes"] = late.tolist()
        else:
            time.sleep(2.5)
            transport.batch_send_recv([P2POperation("send", torch.arange(16, dtype=torch.int64), 0)], 10)
        comm.destroy()
        return out
    finally:
        rt.close()
        dist.destroy_process_group()


def test_expert_weights_move_through_the_real_pyhccl_communicator():
    seen = run_ranks(_rank, {}, world=2, timeout_s=60)
    for s in seen:
        assert s["engine"] == "gloo" and s["queue_bytes_ok"] and s["rearranged_ok"]
    zero = seen[0]
    assert zero["late"] == "TransferTimeout" and 1.0 <= zero["late_s"] < 2.4
    assert zero["late_bytes"] == list(range(16))


def test_a_disabled_communicator_is_refused():
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    group = dist.ProcessGroupGloo(dist.PrefixStore("t", store), 0, 1, timedelta(seconds=5))  # pyright: ignore[reportPrivateImportUsage]
    rt = create_runtime("cpu")
    try:
        comm = PyHcclCommunicator(group, runtime=rt)  # world size 1: disabled, never registered
        with pytest.raises(ConfigError, match="communicator"):
            hccl_transport(comm, control=None)  # type: ignore[arg-type]
    finally:
        rt.close()
