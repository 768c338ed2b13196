# (vLLM is an optional extra: the default environment type-checks without it; run pyright with
# --pythonpath .nox/vllm/bin/python to check these modules against the pinned vLLM.)
"""Lazy, re-entrant registration of this package's engines with vLLM's weight-transfer factories.

Runs in: any process with vLLM (the meta-package's ``vllm.general_plugins`` entry point calls
`register_engines`; a trainer may call it by hand). Importing this module imports nothing heavy;
`register_engines` imports only vLLM's factory module and registers by module path, so the engine
modules load on first use.
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["TRAINER_ENGINES", "WORKER_ENGINES", "register_engines"]

logger = logging.getLogger(__name__)

_PKG = "ascend_dist.weight_transfer"
WORKER_ENGINES: Final[tuple[tuple[str, str, str], ...]] = (
    ("hccl", f"{_PKG}.vllm_engine", "HCCLWeightTransferEngine"),
    ("npu_ipc", f"{_PKG}.vllm_engine", "NPUIPCWeightTransferEngine"),
)
"""(backend name, module path, class name) for ``WeightTransferEngineFactory.register_engine``."""
TRAINER_ENGINES: Final[tuple[tuple[str, str, str], ...]] = (
    ("hccl", f"{_PKG}.vllm_trainer", "HCCLTrainerWeightTransferEngine"),
    ("npu_ipc", f"{_PKG}.vllm_trainer", "NPUIPCTrainerWeightTransferEngine"),
)
"""(backend name, module path, class name) for ``WeightTransferTrainerFactory.register_engine``."""


def register_engines() -> list[str]:
    """Register every engine that is not registered yet; never raises for a name already taken.

    Returns:
        ``"worker:<name>"`` / ``"trainer:<name>"`` for each registration made by this call (empty
        on a second call).

    Raises:
        ImportError: vLLM is not installed.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    made: list[str] = []
    for kind, factory, table in (
        ("worker", WeightTransferEngineFactory, WORKER_ENGINES),
        ("trainer", WeightTransferTrainerFactory, TRAINER_ENGINES),
    ):
        for name, module, cls in table:
            try:
                factory.register_engine(name, module, cls)
            except ValueError:  # already registered (by us earlier, or by someone else): keep it
                logger.debug("weight-transfer %s engine %r already registered; keeping it", kind, name)
                continue
            made.append(f"{kind}:{name}")
    return made
