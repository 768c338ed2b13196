"""The NPU device communicator against vLLM 0.33.0's real base classes (marker ``vllm``).

Run with the pinned vLLM: ``.nox/vllm/bin/python -m pytest -m vllm packages/hccl-ctypes/tests``.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

# vLLM's own base-class all_gather/reduce_scatter call torch APIs that torch 2.14 deprecates.
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def gloo_world() -> Iterator[dist.ProcessGroup]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    try:
        group = dist.group.WORLD
        assert isinstance(group, dist.ProcessGroup)
        yield group
    finally:
        dist.destroy_process_group()


def test_subclass_overrides_and_inherited_collectives(gloo_world: dist.ProcessGroup) -> None:
    from vllm.distributed.device_communicators.base_device_communicator import (
        All2AllManagerBase,
        DeviceCommunicatorBase,
    )

    from ascend_dist.hccl_ctypes.vllm_communicator import NoOpAll2AllManager, NPUCommunicator

    comm = NPUCommunicator(
        cpu_group=gloo_world,
        device=torch.device("cpu"),
        device_group=gloo_world,
        unique_name="ep:0",
        use_all2all=True,
        current_device=lambda: 3,
    )
    assert isinstance(comm, DeviceCommunicatorBase)
    assert comm.device == 3 and isinstance(comm.device, int)
    assert comm.ca_comm is None
    assert comm.is_ep_communicator and comm.use_all2all
    assert (comm.rank, comm.world_size, comm.ranks) == (0, 1, [0])
    manager = comm.all2all_manager
    assert isinstance(manager, NoOpAll2AllManager) and isinstance(manager, All2AllManagerBase)
    # vLLM's model runner: check_ep_fault = get_ep_all2all_manager().support_fault_tolerance
    assert manager.support_fault_tolerance is False
    fault = manager.query_fault()
    assert fault.dtype == torch.bool and fault.dim() == 0 and not fault.item()
    mask = manager.query_active_mask()
    assert mask.dtype == torch.int32 and mask.tolist() == [0]
    assert not bool((mask != torch.zeros_like(mask)).any())  # DeepEP-style fault comparison holds
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(comm.all_reduce(x.clone()), x)
    assert torch.equal(comm.all_gather(x, dim=-1), x)
    assert torch.equal(comm.reduce_scatter(x), x)
    assert torch.equal(comm.broadcast(x.clone(), src=0), x)
    comm.destroy()


def test_stateless_group_arguments_are_forwarded() -> None:
    from ascend_dist.hccl_ctypes.vllm_communicator import NPUCommunicator

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    pg = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=10))  # not registered: "stateless"
    comm = NPUCommunicator(pg, global_ranks=[5], global_world_size=8, current_device=lambda: 0)
    assert (comm.global_rank, comm.global_world_size, comm.ranks) == (5, 8, [5])
    assert comm.all2all_manager is not None and comm.all2all_manager.world_size == 1


def test_device_is_vllms_local_rank_not_the_current_device(gloo_world: dist.ProcessGroup) -> None:
    """Issue 25 item 2: vLLM's GroupCoordinator passes ``<device>:<local rank>``; that index wins over a
    current device that is still 0 (a thread that never called set_device)."""
    from ascend_dist.hccl_ctypes.vllm_communicator import NPUCommunicator

    # "npu" needs torch_npu to parse; any indexed accelerator device exercises the same rule
    comm = NPUCommunicator(cpu_group=gloo_world, device=torch.device("cuda", 3), current_device=lambda: 0)
    assert comm.device == 3
    comm.destroy()
    comm = NPUCommunicator(cpu_group=gloo_world, device=torch.device("cpu"), current_device=lambda: 5)
    assert comm.device == 5  # no index: the current device
    comm.destroy()
