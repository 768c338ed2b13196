"""vLLM adapter: the NPU device communicator and its no-op all-to-all manager.

Runs in: vLLM worker processes on Ascend (selected by the platform's
``get_device_communicator_cls()`` returning ``"ascend_dist.hccl_ctypes.vllm_communicator.NPUCommunicator"``).
The only module of this package that imports vLLM (pinned 0.33.0; classes read from
``vllm/distributed/device_communicators/base_device_communicator.py``).

vLLM's ``GroupCoordinator`` builds it as ``cls(cpu_group=, device=, device_group=, unique_name=,
use_all2all=)`` when the group has more than one rank. All collectives are the base class's
torch.distributed calls on ``device_group`` (an HCCL group on Ascend, gloo on the CPU). Differences
from the base: ``device`` is the current device *index* (an int, as vllm-ascend's group code
expects), ``ca_comm`` is None (so ``graph_capture`` skips custom all-reduce), and
``all2all_manager`` is `NoOpAll2AllManager`, because Ascend does MoE dispatch/combine in its own
kernels while vLLM's model runner still asks the EP group's manager about fault tolerance.
Unlike upstream, ``global_ranks``/``global_world_size`` are forwarded, so stateless (elastic EP)
groups work too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.base_device_communicator import (
    All2AllManagerBase,
    DeviceCommunicatorBase,
)

from ascend_dist.common.device import current_device_index

__all__ = ["NPUCommunicator", "NoOpAll2AllManager"]


def _runtime_device_index() -> int:
    return current_device_index()


class NoOpAll2AllManager(All2AllManagerBase):
    """All-to-all manager that declares "no fault tolerance" and reports every rank live.

    vLLM 0.33.0's model runner reads ``support_fault_tolerance`` of the EP group's manager and, when
    True, polls ``query_fault()`` (a scalar bool tensor) and ``query_active_mask()`` (int32 per rank,
    0 = live). Dispatch/combine stay the base class's ``NotImplementedError``: MoE communication on
    Ascend does not go through this manager.
    """

    def __init__(self, cpu_group: ProcessGroup, tcp_store_group: object | None = None) -> None:
        """Record the group; unlike the base, needs no initialised vLLM DP/TP groups.

        Args:
            cpu_group: The EP group's CPU process group.
            tcp_store_group: Unused; kept for signature parity with the base class.
        """
        # The base constructor queries vLLM's DP/TP groups, which a no-op manager does not need.
        self.cpu_group = cpu_group
        self.tcp_store_group = tcp_store_group
        self.rank = cpu_group.rank()
        self.world_size = cpu_group.size()
        self.internode = False
        self.support_fault_tolerance = False

    def query_active_mask(self) -> torch.Tensor:
        """Every rank live: int32 zeros, one per rank (CPU tensor)."""
        return torch.zeros(self.world_size, dtype=torch.int32)

    def query_fault(self) -> torch.Tensor:
        """No fault has appeared: a scalar bool tensor holding False."""
        return torch.tensor(False)

    def clean_buffers(self) -> None:
        """Nothing to clean: this manager owns no buffers."""

    def destroy(self) -> None:
        """Nothing to release."""


class NPUCommunicator(DeviceCommunicatorBase):
    """vLLM device communicator for Ascend NPUs (collectives from the base class on ``device_group``)."""

    def __init__(  # noqa: PLR0917  (vLLM's DeviceCommunicatorBase signature)
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        global_ranks: list[int] | None = None,
        global_world_size: int | None = None,
        use_all2all: bool = False,
        *,
        current_device: Callable[[], int] = _runtime_device_index,
    ) -> None:
        """Build the communicator as vLLM's ``GroupCoordinator`` does.

        Args:
            cpu_group: The group's CPU (gloo) process group.
            device: vLLM's device for the group (``npu:<local rank>``); replaced by its index, or by
                the current device index when it has none.
            device_group: The device process group (HCCL on Ascend) the collectives run on.
            unique_name: vLLM's group name (``"tp:0"``, ``"ep:0"``, ...).
            global_ranks: Global ranks of a stateless group (forwarded to the base).
            global_world_size: Global world size of a stateless group (forwarded to the base).
            use_all2all: Whether the EP group wants an all-to-all manager.
            current_device: Returns the current device index (default: the device runtime's).
        """
        super().__init__(
            cpu_group,
            device,
            device_group,
            unique_name,
            global_ranks=global_ranks,
            global_world_size=global_world_size,
            use_all2all=use_all2all,
        )
        # vllm-ascend's groups expect an int index. vLLM passes "npu:<local rank>": that rank's device,
        # which a thread that never called set_device would not see as current.
        index = device.index if isinstance(device, torch.device) and device.type != "cpu" else None
        self.device = index if index is not None else current_device()  # type: ignore[assignment]
        self.ca_comm = None
        self.all2all_manager = NoOpAll2AllManager(cpu_group)
