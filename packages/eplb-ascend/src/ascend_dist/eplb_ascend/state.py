"""EPLB state behaviour that does not need vLLM: the fresh-load gate, table refresh, contract detection.

Runs in: the worker. The vLLM adapter (`vllm_eplb.py`) wires these into vLLM's EPLB classes; the
CPU demo uses them directly.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ascend_dist.common.errors import TransferTimeout
from ascend_dist.eplb_ascend.errors import EplbContractError

__all__ = [
    "FreshLoadGate",
    "MappingContract",
    "RefreshableLayerState",
    "detect_mapping_contract",
    "mapping_arguments",
    "refresh_model_routing_tables",
]


class RefreshableLayerState(Protocol):
    """A per-layer EPLB state that keeps a routing table (e.g. `AscendEplbLayerState`)."""

    def refresh_expert_replica_routing_table(self) -> None:
        """Recompute the table in place from the layer's maps."""
        ...


def refresh_model_routing_tables(moe_layers: Iterable[Any], layer_idx: int | None = None) -> int:
    """Refresh the routing table of every MoE layer (or only `layer_idx`); returns how many were refreshed.

    Layers whose ``eplb_state`` has no ``refresh_expert_replica_routing_table`` (plain vLLM layer
    states) are skipped.
    """
    refreshed = 0
    for index, layer in enumerate(moe_layers):
        if layer_idx is not None and index != layer_idx:
            continue
        state = getattr(layer, "eplb_state", None)
        refresh = getattr(state, "refresh_expert_replica_routing_table", None)
        if callable(refresh):
            refresh()
            refreshed += 1
    return refreshed


class FreshLoadGate:
    """Remembers whether this rank recorded load since the last rearrangement; decides collectively.

    `any_rank_fresh` is a collective over the EP group: every rank must call it at the same point,
    and all ranks get the same answer, so either all skip the rebalance or none does.
    """

    def __init__(self, timeout_s: float = 30.0) -> None:
        """Start with no fresh load; collectives wait at most `timeout_s`."""
        self.fresh = False
        self.timeout_s = timeout_s

    def note_step(self, *, is_dummy: bool, is_profile: bool, should_record: bool) -> None:
        """Mark fresh load when a real step falls inside the recording window."""
        if not is_dummy and not is_profile and should_record:
            self.fresh = True

    def clear(self) -> None:
        """Forget the load (after a rearrangement)."""
        self.fresh = False

    def any_rank_fresh(self, coordinator: Any, device: torch.device | str = "cpu") -> bool:
        """Sum the flags over the coordinator's ``cpu_group`` (else ``device_group``); True when any is set."""
        group = getattr(coordinator, "cpu_group", None)
        on = torch.device("cpu")
        if group is None:
            group, on = coordinator.device_group, torch.device(device)
        if group is None or dist.get_world_size(group) <= 1:
            return self.fresh
        flag = torch.tensor([int(self.fresh)], dtype=torch.int32, device=on)
        work = dist.all_reduce(flag, group=group, async_op=True)
        assert work is not None
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise TransferTimeout(f"fresh-load all-reduce failed or timed out ({exc})") from exc
        return int(flag.item()) > 0


class MappingContract(enum.Enum):
    """How a vLLM ``EplbState.from_mapping`` takes the expanded mapping."""

    EXPANDED = "expanded"
    """vLLM 0.33: ``(model, model_config, device, parallel_config, expanded_physical_to_logical)``."""
    EXPANDED_WITH_VALID_COUNT = "expanded_with_valid_count"
    """vLLM 0.27: the same plus ``num_valid_physical_experts``."""


_REQUIRED = ("model", "model_config", "device", "parallel_config", "expanded_physical_to_logical")


def detect_mapping_contract(from_mapping: Callable[..., Any]) -> MappingContract:
    """Read the contract from the signature (never from a version string).

    Raises:
        EplbContractError: a required parameter is missing or an unknown one is required.
    """
    params = inspect.signature(from_mapping).parameters
    missing = [p for p in _REQUIRED if p not in params]
    if missing:
        raise EplbContractError(f"Unsupported vLLM EPLB contract: from_mapping lacks {missing}.")
    known = {*_REQUIRED, "num_valid_physical_experts", "cls", "self"}
    unknown = [
        name for name, p in params.items()
        if name not in known and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]  # fmt: skip
    if unknown:
        raise EplbContractError(f"Unsupported vLLM EPLB contract: from_mapping requires unknown {unknown}.")
    if "num_valid_physical_experts" in params:
        return MappingContract.EXPANDED_WITH_VALID_COUNT
    return MappingContract.EXPANDED


def mapping_arguments(
    contract: MappingContract, expanded_physical_to_logical: torch.Tensor, num_valid_physical_experts: int | None
) -> dict[str, Any]:
    """Keyword arguments for the mapping part of ``from_mapping`` under `contract`."""
    kwargs: dict[str, Any] = {"expanded_physical_to_logical": expanded_physical_to_logical}
    if contract is MappingContract.EXPANDED_WITH_VALID_COUNT:
        count = num_valid_physical_experts
        kwargs["num_valid_physical_experts"] = int(expanded_physical_to_logical.shape[-1]) if count is None else count
    return kwargs
