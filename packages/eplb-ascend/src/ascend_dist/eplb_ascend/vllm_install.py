"""Puts the Ascend EPLB hooks into vLLM at start-up; the ascend-dist plugin calls `install` in every vLLM process.

Runs in: vLLM processes (imports vLLM's EPLB modules; nothing is constructed until vLLM asks).

vLLM 0.33 picks its EPLB communicator with a closed list of names (``EPLBConfig.communicator``:
``torch_nccl``, ``torch_gloo``, ``torch_xccl``, ``nixl``, ``pynccl``) inside
``create_eplb_communicator``, which ``eplb_state`` imported by name. `install` wraps both references
(`wrap_communicator_factory`) so that call returns ours when ``ASCEND_DIST_EPLB_COMMUNICATOR`` says
so, and wraps ``eplb_state._move_to_workspace`` so an async per-layer commit refreshes that layer's
routing table (`wrap_move_to_workspace`). Both wrappers are idempotent and check vLLM's signatures.

``ASCEND_DIST_EPLB_COMMUNICATOR``:

- ``auto`` (default): `HcclEplbCommunicator` when the expert weights are on an NPU, else vLLM's own;
- ``hccl``: always `HcclEplbCommunicator` (on the CPU: the communicator's gloo engine);
- ``gloo``: `AscendEplbCommunicator` over the EP group's ``cpu_group`` (device tensors staged through host);
- ``vllm``: vLLM's own choice, untouched.

The layer and model states (`AscendEplbLayerState`, `AscendEplbState`) are not installed here: the
Ascend platform's MoE layers construct them (see the README).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ascend_dist.common.errors import ConfigError

__all__ = ["CHOICES", "COMMUNICATOR_ENV", "communicator_choice", "install", "select_communicator"]

logger = logging.getLogger(__name__)

COMMUNICATOR_ENV: Final[str] = "ASCEND_DIST_EPLB_COMMUNICATOR"
CHOICES: Final[tuple[str, ...]] = ("auto", "hccl", "gloo", "vllm")


def communicator_choice(environ: Mapping[str, str] = os.environ) -> str:
    """The configured choice (``auto`` when unset).

    Raises:
        ConfigError: A value outside `CHOICES` (named with the variable).
    """
    value = environ.get(COMMUNICATOR_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ConfigError(COMMUNICATOR_ENV, value, f"one of {', '.join(CHOICES)}")
    return value


def select_communicator(
    group_coordinator: Any, expert_weights: Sequence[Sequence[Any]], *, choice: str | None = None
) -> Any:  # vLLM's GroupCoordinator in, an EplbCommunicator (or None: vLLM's) out
    """Our communicator for this EP group, or None to let vLLM build its own."""
    from ascend_dist.eplb_ascend.vllm_eplb import AscendEplbCommunicator, HcclEplbCommunicator

    picked = choice if choice is not None else communicator_choice()
    if picked == "auto":
        first = expert_weights[0][0] if expert_weights and expert_weights[0] else None
        picked = "hccl" if first is not None and first.device.type == "npu" else "vllm"
    if picked == "vllm":
        return None
    if picked == "gloo":
        return AscendEplbCommunicator.over_cpu_group(group_coordinator)
    logger.info("EPLB communicator: HcclEplbCommunicator (%s=%s)", COMMUNICATOR_ENV, picked)
    return HcclEplbCommunicator.over_group(group_coordinator)


def install() -> list[str]:
    """Wrap vLLM's EPLB communicator factory (both references) and async layer commit; returns what it wrapped.

    Idempotent: a second call wraps nothing.

    Raises:
        EplbContractError: vLLM's signatures changed (the plugin logs it and leaves vLLM as it is).
    """
    from vllm.distributed.eplb import eplb_communicator, eplb_state

    from ascend_dist.eplb_ascend.vllm_eplb import wrap_communicator_factory, wrap_move_to_workspace

    done = []
    for module in (eplb_communicator, eplb_state):
        original = module.create_eplb_communicator
        wrapped = wrap_communicator_factory(original, select_communicator)
        if wrapped is not original:
            setattr(module, "create_eplb_communicator", wrapped)  # noqa: B010 (a module pyright types narrowly)
            done.append(f"{module.__name__}.create_eplb_communicator")
    original = eplb_state._move_to_workspace
    wrapped = wrap_move_to_workspace(original)
    if wrapped is not original:
        eplb_state._move_to_workspace = wrapped
        done.append(f"{eplb_state.__name__}._move_to_workspace")
    return done
