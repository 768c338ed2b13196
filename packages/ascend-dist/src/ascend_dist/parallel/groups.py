"""The Ascend process groups of one worker: created from the pure rank lists, destroyed for real.

Runs in: every worker process, once after vLLM's own model-parallel groups exist.

Groups are created through a `GroupFactory`, so the same code runs over vLLM's
`init_model_parallel_group` (see `ascend_dist.parallel.vllm_groups`) or over plain gloo groups in tests.
Unlike upstream, `destroy()` is part of the lifecycle (`AscendProcessGroups` is a context manager),
after which the groups can be created again in the same process::

    with AscendProcessGroups() as groups:
        groups.create(layout, options, rank=r, local_rank=lr, backend="hccl", factory=f)
        ...  # every group is destroyed on exit, even on error
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ascend_dist.common.errors import AscendDistError, ConfigError
from ascend_dist.parallel.layout import (
    ParallelLayout,
    compute_finegrained_groups,
    compute_mc2_groups,
    compute_p_tp_groups,
)

__all__ = [
    "AscendGroupOptions",
    "AscendProcessGroups",
    "Coordinator",
    "GroupFactory",
    "GroupNotInitialized",
]

logger = logging.getLogger(__name__)

SLOTS = ("mc2", "dynamic_eplb", "p_tp", "otp", "lmhead_tp", "embed_tp", "mlp_tp")
# Fine-grained TP slot -> (option field, group name); same-size groups share one coordinator.
FINEGRAINED = (
    ("otp", "oproj_tp_size", "otp"),
    ("lmhead_tp", "lmhead_tp_size", "lmheadtp"),
    ("embed_tp", "embedding_tp_size", "emtp"),
    ("mlp_tp", "mlp_tp_size", "mlptp"),
)


class Coordinator(Protocol):
    """What we need of a group coordinator (vLLM's GroupCoordinator has it)."""

    def destroy(self) -> None:
        """Release the group."""
        ...


class GroupFactory(Protocol):
    """Creates one group family; every rank calls it with all groups and gets the coordinator of its own."""

    def __call__(self, group_ranks: list[list[int]], local_rank: int, backend: str, group_name: str) -> Coordinator:
        """Create the family `group_name` and return this rank's coordinator."""
        ...


class GroupNotInitialized(AscendDistError, RuntimeError):
    """An Ascend group was requested before `AscendProcessGroups.create` (or after `destroy`)."""


@dataclass(frozen=True)
class AscendGroupOptions:
    """The switches that decide which optional groups exist (vllm-ascend's ascend_config fields)."""

    pd_tp_ratio: int = 1
    pd_head_ratio: int = 1
    num_head_replica: int = 0
    is_kv_producer: bool = False
    dynamic_eplb: bool = False
    oproj_tp_size: int = 0
    lmhead_tp_size: int = 0
    embedding_tp_size: int = 0
    mlp_tp_size: int = 0


class AscendProcessGroups:
    """Holds this process's Ascend groups; thread-safe, re-creatable after `destroy`."""

    def __init__(self) -> None:
        """Start with no groups."""
        self._lock = threading.Lock()
        self._slots: dict[str, Coordinator] = {}

    @property
    def initialized(self) -> bool:
        """True between `create` and `destroy`."""
        return "mc2" in self._slots

    def create(
        self,
        layout: ParallelLayout,
        options: AscendGroupOptions,
        *,
        rank: int,
        local_rank: int,
        backend: str,
        factory: GroupFactory,
    ) -> None:
        """Create every group the options ask for; a second call while initialized does nothing."""
        if not 0 <= rank < layout.world_size:
            raise ConfigError("rank", rank, f"0..{layout.world_size - 1}")
        with self._lock:
            if self.initialized:
                return
            created: dict[str, Coordinator] = {}
            try:
                self._create_all(created, layout, options, rank, lambda ranks, name: factory(
                    ranks, local_rank, backend, name))  # fmt: skip
            except BaseException:
                _destroy_all(created)
                raise
            self._slots = created

    @staticmethod
    def _create_all(
        created: dict[str, Coordinator],
        layout: ParallelLayout,
        options: AscendGroupOptions,
        rank: int,
        make: Callable[[list[list[int]], str], Coordinator],
    ) -> None:
        if options.pd_head_ratio > 1 and options.is_kv_producer:
            groups = compute_p_tp_groups(
                layout, pd_tp_ratio=options.pd_tp_ratio, num_head_replica=options.num_head_replica
            )
            # Named after the group holding this rank's GLOBAL rank (upstream uses the node-local
            # rank, so names collide across nodes).
            index = next(i for i, g in enumerate(groups) if rank in g)
            created["p_tp"] = make(groups, f"p_tp_{index}")
        mc2 = compute_mc2_groups(layout)
        created["mc2"] = make(mc2, "mc2")
        if options.dynamic_eplb:
            created["dynamic_eplb"] = make(mc2, "dynamic_eplb")
        by_size: dict[int, Coordinator] = {}
        for slot, field, name in FINEGRAINED:
            size = getattr(options, field)
            if size <= 0:
                continue
            if size not in by_size:
                by_size[size] = make(compute_finegrained_groups(layout, size, name=field), name)
            created[slot] = by_size[size]

    def get(self, slot: str) -> Coordinator:
        """This rank's coordinator of `slot` (one of SLOTS)."""
        if slot not in SLOTS:
            raise ConfigError("slot", slot, ", ".join(SLOTS))
        try:
            return self._slots[slot]
        except KeyError:
            raise GroupNotInitialized(f"the {slot} group is not initialized") from None

    def has(self, slot: str) -> bool:
        """Whether `slot` was created."""
        return slot in self._slots

    def destroy(self) -> None:
        """Destroy every group once (shared coordinators once too); idempotent."""
        with self._lock:
            slots, self._slots = self._slots, {}
        _destroy_all(slots)

    def __enter__(self) -> AscendProcessGroups:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()


def _destroy_all(slots: dict[str, Coordinator]) -> None:
    seen: set[int] = set()
    for slot, coordinator in slots.items():
        if id(coordinator) in seen:
            continue
        seen.add(id(coordinator))
        try:
            coordinator.destroy()
        except Exception:  # keep destroying the others; a leak is better than a stuck teardown
            logger.exception("destroying the %s group failed", slot)
