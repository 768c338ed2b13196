"""The vLLM adapter: Ascend EPLB state and communicator as subclasses of the pinned vLLM's EPLB classes.

Runs in: the vLLM worker. The only module of this package that imports vllm (``vllm>=0.33,<0.34``,
the ``vllm`` extra). Thin: the logic lives in `tables`, `state`, `communicator` and `transport`.

- `AscendEplbLayerState` (an ``EplbLayerState``) keeps the layer's expert replica routing table and
  refreshes it in place whenever its maps are set.
- `AscendEplbState` (an ``EplbState``) skips a rebalance when no EP rank recorded fresh load (a
  collective decision), refreshes routing tables after a synchronous rearrangement and after
  `from_mapping`, which it calls with the mapping contract read from vLLM's signature.
- `AscendEplbCommunicator` (an ``EplbCommunicator``) moves expert weights through a `P2PTransport`
  (gloo on CPU; the HCCL seam on Ascend) and needs no profile buffer reservation.
- `HcclEplbCommunicator` is that communicator over a `PyHcclCommunicator` of the EP group.
- `wrap_move_to_workspace` / `wrap_communicator_factory` are the hooks on
  ``vllm.distributed.eplb.eplb_state`` (async per-layer commit, communicator selection);
  `vllm_install.install` puts them in place at start-up (the ascend-dist plugin calls it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from vllm.distributed.eplb.eplb_communicator import EplbCommunicator
from vllm.distributed.eplb.eplb_state import EplbLayerState, EplbState

from ascend_dist.eplb_ascend.communicator import ExpertTransferQueue
from ascend_dist.eplb_ascend.errors import EplbContractError, EplbStateError
from ascend_dist.eplb_ascend.state import (
    FreshLoadGate,
    detect_mapping_contract,
    mapping_arguments,
    refresh_model_routing_tables,
)
from ascend_dist.eplb_ascend.tables import refresh_or_build
from ascend_dist.eplb_ascend.transport import GlooTransport, P2PTransport

__all__ = [
    "AscendEplbCommunicator",
    "AscendEplbLayerState",
    "AscendEplbState",
    "HcclEplbCommunicator",
    "wrap_communicator_factory",
    "wrap_move_to_workspace",
]

logger = logging.getLogger(__name__)
_WRAPPED = "__ascend_dist_wrapped__"


def _ep_coordinator() -> Any:
    from vllm.distributed import get_ep_group

    return get_ep_group()


@dataclasses.dataclass
class AscendEplbLayerState(EplbLayerState):
    """vLLM's layer state plus the ``[1024, E]`` routing table, refreshed in place.

    `ep_rank` None means "ask vLLM's EP group" at refresh time.
    """

    expert_replica_routing_table: torch.Tensor | None = None
    ep_rank: int | None = None

    @classmethod
    def from_upstream(cls, state: EplbLayerState) -> AscendEplbLayerState:
        """A new Ascend layer state carrying every field of an upstream one."""
        values = {f.name: getattr(state, f.name) for f in dataclasses.fields(EplbLayerState)}
        return cls(**values)

    def set_layer_state(
        self,
        moe_layer_idx: int,
        expert_load_view: torch.Tensor,
        logical_to_physical_map: torch.Tensor,
        logical_replica_count: torch.Tensor,
    ) -> None:
        """VLLM's behaviour (row views of the model maps), then a table refresh."""
        super().set_layer_state(moe_layer_idx, expert_load_view, logical_to_physical_map, logical_replica_count)
        self.refresh_expert_replica_routing_table()

    def refresh_expert_replica_routing_table(self) -> None:
        """Rebuild the table from the current maps, in place when the shape still fits."""
        if self.logical_to_physical_map is None or self.logical_replica_count is None:
            raise EplbStateError(
                "Cannot build the expert replica routing table before Ascend EPLB layer state is initialized."
            )
        rank = self.ep_rank if self.ep_rank is not None else int(_ep_coordinator().rank_in_group)
        self.expert_replica_routing_table = refresh_or_build(
            self.expert_replica_routing_table, self.logical_to_physical_map, self.logical_replica_count, rank
        )


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(fn).parameters


class AscendEplbState(EplbState):
    """vLLM's EPLB state with the fresh-load gate and routing-table refreshes.

    Args:
        parallel_config: vLLM's ParallelConfig.
        device: the worker's device.
        ep_group: the EP group coordinator (``cpu_group``/``device_group``/``rank_in_group``);
            default vLLM's ``get_ep_group()`` at use time.
        gate_timeout_s: deadline of the fresh-load all-reduce.
    """

    def __init__(
        self, parallel_config: Any, device: torch.device, *, ep_group: Any = None, gate_timeout_s: float = 30.0
    ) -> None:
        """Base state plus an empty fresh-load gate."""
        super().__init__(parallel_config, device)
        self._fresh_gate = FreshLoadGate(gate_timeout_s)
        self._ep_group = ep_group

    @property
    def has_fresh_recorded_load(self) -> bool:
        """Whether this rank recorded load since the last rearrangement."""
        return self._fresh_gate.fresh

    def step(self, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
        """Note fresh load when this step records it, then vLLM's step."""
        if not is_dummy and not is_profile:
            self._fresh_gate.note_step(
                is_dummy=False, is_profile=False, should_record=self._should_record_current_step(log_stats=log_stats)
            )
        super().step(is_dummy=is_dummy, is_profile=is_profile, log_stats=log_stats)

    def has_global_fresh_recorded_load(self) -> bool:
        """Collective over the EP group: did any rank record fresh load?"""
        return self._fresh_gate.any_rank_fresh(self._ep_group or _ep_coordinator(), self.device)

    def rearrange(
        self, is_profile: bool = False, rank_mapping: dict[int, int] | None = None, use_last_expert_load: bool = False
    ) -> torch.Tensor | None:
        """Skip when no rank has fresh load (same decision on every rank); else vLLM's, then refresh tables.

        Elastic-EP, rank-mapping, profile and saved-load rearrangements are never gated.
        """
        gate = getattr(self, "_fresh_gate", None)
        gated = (
            gate is not None and not is_profile and rank_mapping is None
            and not self.parallel_config.enable_elastic_ep and not use_last_expert_load
        )  # fmt: skip
        kwargs: dict[str, Any] = {}
        if use_last_expert_load or _accepts(EplbState.rearrange, "use_last_expert_load"):
            kwargs["use_last_expert_load"] = use_last_expert_load
        if gated and not self.has_global_fresh_recorded_load():
            logger.info("EPLB: no rank recorded fresh expert load; rearrangement skipped")
            return None
        result = super().rearrange(is_profile=is_profile, rank_mapping=rank_mapping, **kwargs)
        if not is_profile and not self.is_async:
            for model_state in self.model_states.values():
                refresh_model_routing_tables(model_state.model.moe_layers)
        if not is_profile and gate is not None:
            gate.clear()
        return result

    @classmethod
    def from_mapping(  # type: ignore[override]  # noqa: PLR0917 (vLLM's signature)
        cls,
        model: Any,
        model_config: Any,
        device: torch.device,
        parallel_config: Any,
        expanded_physical_to_logical: torch.Tensor,
        num_valid_physical_experts: int | None = None,
    ) -> AscendEplbState:
        """VLLM's from_mapping under whichever mapping contract it has, then refresh every table."""
        contract = detect_mapping_contract(EplbState.from_mapping)
        base: Callable[..., Any] = super().from_mapping
        state = base(
            model=model, model_config=model_config, device=device, parallel_config=parallel_config,
            **mapping_arguments(contract, expanded_physical_to_logical, num_valid_physical_experts),
        )  # fmt: skip
        assert isinstance(state, AscendEplbState)
        for model_state in state.model_states.values():
            refresh_model_routing_tables(model_state.model.moe_layers)
        return state


class AscendEplbCommunicator(EplbCommunicator):
    """vLLM's EPLB communicator contract over a `P2PTransport`; no profile buffer reservation."""

    def __init__(
        self,
        transport: P2PTransport,
        *,
        timeout_s: float = 30.0,
        require_standalone: bool = True,
        stage_through_cpu: bool = False,
        stream: Any = None,
    ) -> None:
        """Queue expert transfers onto `transport` (see `ExpertTransferQueue` for the options)."""
        self._queue = ExpertTransferQueue(
            transport, timeout_s=timeout_s, require_standalone=require_standalone, stage_through_cpu=stage_through_cpu
        )
        self._stream = stream
        logger.debug("Initialized EPLB communicator: %s", type(self).__name__)

    @classmethod
    def over_cpu_group(cls, group_coordinator: Any, **kwargs: Any) -> AscendEplbCommunicator:
        """Over the coordinator's gloo ``cpu_group``, staging device tensors through CPU."""
        kwargs.setdefault("stage_through_cpu", True)
        return cls(GlooTransport(group_coordinator.cpu_group), **kwargs)

    @property
    def needs_profile_buffer_reservation(self) -> bool:
        """False: buffers are taken lazily by the first real transfer."""
        return False

    def add_send(self, tensors: list[torch.Tensor], dst_rank: int, expert_id: int) -> None:
        """Queue a send of one expert's tensors to group rank `dst_rank`."""
        self._queue.add_send(tensors, dst_rank, expert_id)

    def add_recv(self, tensors: list[torch.Tensor], src_rank: int, expert_id: int) -> None:
        """Queue a receive of one expert's tensors from group rank `src_rank`."""
        self._queue.add_recv(tensors, src_rank, expert_id)

    def execute(self) -> None:
        """Run the queued transfers within the deadline; the queue is always cleared."""
        self._queue.execute()

    def set_transfer_context(self, old_indices: np.ndarray, layer_idx: int) -> None:
        """Unused: every transfer is posted by add_send/add_recv."""


def _bytes_group(group_coordinator: Any) -> Any:
    """The gloo group the communicator is built on, never the one the control votes travel on.

    The HCCL library uses it only to exchange its root info, but the CPU runtime's gloo engine sends
    the expert bytes over it: sharing the control's ``cpu_group`` would interleave the two streams
    of operations. vLLM's ``device_group`` is gloo on the CPU, so it carries the bytes there.
    """
    import torch.distributed as dist

    device_group = getattr(group_coordinator, "device_group", None)
    if device_group is not None and dist.get_backend(device_group) == "gloo":
        return device_group
    return group_coordinator.cpu_group


class HcclEplbCommunicator(AscendEplbCommunicator):
    """Expert weights over a `PyHcclCommunicator` of the EP group (HCCL on Ascend; its gloo engine on the CPU).

    Control (fingerprints, votes) travels on the group's gloo ``cpu_group``; the bytes on the
    communicator's stream (`hccl_transport`). The class vLLM's ``create_eplb_communicator`` returns
    once `vllm_install.install` ran and ``ASCEND_DIST_EPLB_COMMUNICATOR`` selects ``hccl`` (the default
    for expert weights on an NPU).
    """

    def __init__(self, communicator: Any, control: P2PTransport, **kwargs: Any) -> None:  # a PyHcclCommunicator
        """Move expert bytes over ``communicator``, control over ``control`` (same group, same ranks)."""
        from ascend_dist.eplb_ascend.hccl_transport import hccl_transport

        super().__init__(hccl_transport(communicator, control), **kwargs)
        self.communicator = communicator

    @classmethod
    def over_group(cls, group_coordinator: Any, *, runtime: Any = None, **kwargs: Any) -> HcclEplbCommunicator:
        """Build one over vLLM's EP ``group_coordinator`` (collective: every EP rank calls it).

        ``runtime``: the device runtime to enqueue on; None: this process's runtime of the
        coordinator's device (each rank its own).
        """
        from ascend_dist.common.device import get_runtime
        from ascend_dist.hccl_ctypes import PyHcclCommunicator

        kwargs.setdefault(
            "require_standalone", False
        )  # the binding sends from data_ptr(): views of stacked experts work
        rt = runtime if runtime is not None else get_runtime(getattr(group_coordinator, "device", None))
        communicator = PyHcclCommunicator(_bytes_group(group_coordinator), runtime=rt)
        return cls(communicator, GlooTransport(group_coordinator.cpu_group), **kwargs)


def wrap_move_to_workspace(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap vLLM's async per-layer commit so the committed layer's routing table is refreshed.

    Raises:
        EplbContractError: the function lacks ``model_state``/``ep_rank``.
    """
    if getattr(original, _WRAPPED, False):
        return original
    if not (_accepts(original, "model_state") and _accepts(original, "ep_rank")):
        raise EplbContractError("Unsupported vLLM EPLB contract: async workspace move signature changed.")

    @functools.wraps(original)
    def move_to_workspace(model_state: Any, ep_rank: int, *args: Any, **kwargs: Any) -> Any:
        pending = getattr(model_state, "pending_result", None)
        layer_idx = getattr(pending, "layer_idx", None)  # read first: the original clears it
        result = original(model_state=model_state, ep_rank=ep_rank, *args, **kwargs)  # noqa: B026
        if layer_idx is not None:
            refresh_model_routing_tables(model_state.model.moe_layers, layer_idx)
        return result

    setattr(move_to_workspace, _WRAPPED, True)
    return move_to_workspace


def wrap_communicator_factory(
    original: Callable[..., EplbCommunicator],
    make: Callable[[Any, Sequence[Sequence[torch.Tensor]]], EplbCommunicator | None],
) -> Callable[..., EplbCommunicator]:
    """Wrap ``create_eplb_communicator``: `make(group_coordinator, expert_weights)` may return ours.

    `make` returning None delegates to vLLM's factory (e.g. for backends other than ``torch_nccl``).

    Raises:
        EplbContractError: the factory lacks one of its four known parameters.
    """
    if getattr(original, _WRAPPED, False):
        return original
    signature = inspect.signature(original)
    required = ("group_coordinator", "backend", "expert_weights", "expert_buffer")
    if any(name not in signature.parameters for name in required):
        raise EplbContractError("Unsupported vLLM EPLB contract: communicator factory signature changed.")

    @functools.wraps(original)
    def create(*args: Any, **kwargs: Any) -> EplbCommunicator:
        bound = signature.bind(*args, **kwargs)
        ours = make(bound.arguments["group_coordinator"], bound.arguments["expert_weights"])
        return ours if ours is not None else original(*args, **kwargs)

    setattr(create, _WRAPPED, True)
    return create
