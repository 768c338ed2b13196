"""`PyHcclCommunicator` in one process: world size 1, argument checks, the CPU runtime's streams."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from ascend_dist.common.device import CpuSimRuntime, create_runtime
from ascend_dist.common.errors import ConfigError
from ascend_dist.hccl_ctypes import CommunicatorClosed
from ascend_dist.hccl_ctypes.communicator import PyHcclCommunicator


@pytest.fixture
def world1() -> Iterator[dist.ProcessGroup]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        yield group
    finally:
        dist.destroy_process_group()


@pytest.fixture
def runtime() -> Iterator[CpuSimRuntime]:
    rt = create_runtime("cpu")
    assert isinstance(rt, CpuSimRuntime)
    try:
        yield rt
    finally:
        rt.close()


def test_world_size_one_is_disabled_but_computes_locally(world1: dist.ProcessGroup, runtime: CpuSimRuntime) -> None:
    with PyHcclCommunicator(world1, runtime=runtime, library_path="/nonexistent/libhccl.so") as comm:
        assert (comm.rank, comm.world_size, comm.disabled, comm.available) == (0, 1, True, False)
        assert comm.library is None  # no library load at world size 1
        x = torch.arange(4, dtype=torch.float32)
        y = comm.all_reduce(x)
        g = comm.all_gather(torch.ones(2, 3))
        r = comm.reduce_scatter(torch.arange(6, dtype=torch.int64))
        comm.broadcast(x, src=0)
        runtime.synchronize(10)
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
        assert g.shape == (2, 3) and torch.equal(g, torch.ones(2, 3))
        assert torch.equal(r, torch.arange(6))
        with pytest.raises(ConfigError, match="world_size=1"):
            comm.send(x, 0)
        with pytest.raises(ConfigError, match="src=1"):
            comm.broadcast(x, src=1)
    with pytest.raises(CommunicatorClosed):
        comm.all_reduce(x)
    comm.destroy()  # idempotent


def test_bad_arguments_are_typed(world1: dist.ProcessGroup, runtime: CpuSimRuntime) -> None:
    with pytest.raises(ConfigError, match="backend='mpi'"):
        PyHcclCommunicator(world1, runtime=runtime, backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="device='cuda:0'"):
        PyHcclCommunicator(world1, "cuda:0", runtime=runtime)
    with pytest.raises(ConfigError, match="group='object'"):
        PyHcclCommunicator(object(), runtime=runtime)  # type: ignore[arg-type]
    comm = PyHcclCommunicator(world1, 0, runtime=runtime)
    assert comm.device == torch.device("cpu")
    with pytest.raises(ConfigError, match="in_tensor='list'"):
        comm.all_reduce([1.0])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="out_tensor="):
        comm.all_reduce(torch.ones(4), torch.ones(4, dtype=torch.float64))
    comm.destroy()
