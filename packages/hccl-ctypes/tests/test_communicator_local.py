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
        comm.all_reduce(torch.ones(4), out_tensor=torch.ones(4, dtype=torch.float64))
    comm.destroy()


@pytest.fixture
def cpu_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from ascend_dist.common.device import DEVICE_ENV, close_runtime

    monkeypatch.setenv(DEVICE_ENV, "cpu")
    close_runtime()
    try:
        yield
    finally:
        close_runtime()


@pytest.mark.usefixtures("cpu_process")
def test_each_rank_enqueues_on_its_own_devices_runtime(world1: dist.ProcessGroup) -> None:
    """Issue 25 item 2: the communicator's runtime (hence its streams) is its device's, not device 0's."""
    from ascend_dist.common.device import get_runtime, set_current_device

    for device in (2, "cpu:2", torch.device("cpu", 2)):
        with PyHcclCommunicator(world1, device=device) as comm:
            assert comm.runtime is get_runtime(2) and comm.runtime.device_index == 2
            x = torch.arange(4, dtype=torch.float32)
            y = comm.all_reduce(x)  # on device 2's current stream
            comm.runtime.current_stream().synchronize(10)
            assert torch.equal(y, x)
    set_current_device(3)  # vLLM's worker: set_device(local_rank), then build the communicator
    with PyHcclCommunicator(world1) as comm:
        assert comm.runtime.device_index == 3 and comm.runtime is not get_runtime(0)


def test_a_device_other_than_the_runtimes_is_refused(world1: dist.ProcessGroup, runtime: CpuSimRuntime) -> None:
    with pytest.raises(ConfigError, match="device"):
        PyHcclCommunicator(world1, device=1, runtime=runtime)  # would enqueue on device 0's stream
    with pytest.raises(ConfigError, match="device"):
        PyHcclCommunicator(world1, device="cpu:x", runtime=runtime)
    PyHcclCommunicator(world1, device=0, runtime=runtime).destroy()


def test_destroy_never_releases_the_engine_under_a_queued_operation() -> None:
    """Issue 25 item 4: a destroy whose stream wait timed out released the engine anyway, and the queued
    all-reduce then ran on it. Now the queued operation fails with CommunicatorClosed at the stream's sync."""
    import datetime
    import threading

    from ascend_dist.common.errors import DeadlineExceeded

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)  # fmt: skip
    runtimes = [create_runtime("cpu", device_index=r) for r in range(2)]
    comms: list[PyHcclCommunicator | None] = [None, None]

    def build(rank: int) -> None:
        client = store if rank == 0 else dist.TCPStore("127.0.0.1", port, 2, is_master=False,
                                                       timeout=datetime.timedelta(seconds=10))  # fmt: skip
        group = dist.ProcessGroupGloo(client, rank, 2, datetime.timedelta(seconds=10))
        comms[rank] = PyHcclCommunicator(group, runtime=runtimes[rank], backend="gloo", op_timeout_s=2.0)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    comm, peer = comms
    assert comm is not None and peer is not None
    gate = threading.Event()
    try:
        stream = runtimes[0].new_stream()
        runtimes[0].launch_host_func(stream, lambda: gate.wait(10))  # the stream is busy...
        comm.all_reduce(torch.ones(4), stream=stream)  # ...so the all-reduce is queued behind it
        with pytest.raises(DeadlineExceeded):
            comm.destroy(timeout_s=0.3)
        gate.set()
        with pytest.raises(CommunicatorClosed, match="queued"):
            stream.synchronize(10)  # refused, not run on a released engine (it would wait 2 s for rank 1)
    finally:
        gate.set()
        peer.destroy()
        for rt in runtimes:
            rt.close()
