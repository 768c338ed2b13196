"""vLLM general plugin: registers the installed ascend_dist components with vLLM, lazily.

Runs in: every vLLM process (entry-point group `vllm.general_plugins`), possibly more than once.
`register()` is re-entrant, imports no component module and nothing heavy, skips components that
are not installed, keeps a name someone else registered first (with one warning), and never raises:
an exception here would abort vLLM's start-up. Components that patch vLLM rather than register a
name (eplb-ascend's EPLB communicator and async commit) run when the vLLM module they patch is
imported (`startup_hooks`, listed as ``startup:<name>`` in `registered_names`).

vLLM's public registration refuses a name it already holds. vllm-ascend's offload configs name two
of vLLM's own connectors (`OffloadingConnector`, `SimpleCPUOffloadConnector`: vllm-ascend replaced
them with its Ascend subclasses), so those two names, and only while vLLM's own entry is still the
one registered, are pointed at ours (`VLLM_NAME_OVERRIDES`, one INFO line each); this is the only
write to a vLLM registry outside its public API. vLLM's stock classes stay reachable with
``kv_connector_module_path``.

Our modules log under ``ascend_dist``; in a vLLM process those records go out through vLLM's own
handlers (its format, level and stream: `route_logs_through_vllm`), so an operator reads our
warnings in the same stream, with the same process names, as vLLM's.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ascend_dist.plugin import startup_hooks

__all__ = [
    "COMPONENTS",
    "FACTORIES",
    "VLLM_NAME_OVERRIDES",
    "Component",
    "register",
    "registered_names",
    "route_logs_through_vllm",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Component:
    """One registration: `name` (what users put in their config) -> `module:class_name`, in `factory`."""

    factory: str
    name: str
    module: str
    class_name: str


# factory key -> (module, class, registering classmethod) in the pinned vLLM.
FACTORIES: dict[str, tuple[str, str, str]] = {
    "kv_connector": ("vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory", "register_connector"),
    "weight_transfer": ("vllm.distributed.weight_transfer.factory", "WeightTransferEngineFactory", "register_engine"),
    "weight_transfer_trainer": (
        "vllm.distributed.weight_transfer.factory",
        "WeightTransferTrainerFactory",
        "register_engine",
    ),
}

# KV connector names are vllm-ascend's, so existing deployment configs keep working. vLLM itself owns
# `OffloadingConnector`, `SimpleCPUOffloadConnector` and `MultiConnector`; ours take an `Ascend` prefix
# (or select them with `kv_connector_module_path`, see the README) instead of overwriting vLLM's.
COMPONENTS: tuple[Component, ...] = (
    Component(
        "kv_connector", "MooncakeConnectorV1", "ascend_dist.kv_mooncake.pull.vllm_connector", "MooncakeConnectorV1"
    ),
    Component(
        "kv_connector",
        "MooncakeHybridConnector",
        "ascend_dist.kv_mooncake.pull.vllm_connector",
        "MooncakeHybridConnector",
    ),
    Component(
        "kv_connector",
        "MooncakeLayerwiseConnector",
        "ascend_dist.kv_mooncake.push.vllm_connector",
        "MooncakeLayerwiseConnector",
    ),
    Component(
        "kv_connector", "SfaRemoteD2HConnector", "ascend_dist.kv_mooncake.sfa.vllm_connector", "SfaRemoteD2HConnector"
    ),
    Component("kv_connector", "AscendStoreConnector", "ascend_dist.kv_store.vllm_connector", "AscendStoreConnector"),
    Component(
        "kv_connector", "MooncakeConnectorStoreV1", "ascend_dist.kv_store.vllm_connector", "MooncakeConnectorStoreV1"
    ),
    Component(
        "kv_connector",
        "RecomputeCPUOffloadConnector",
        "ascend_dist.kv_offload.vllm_recompute",
        "RecomputeCPUOffloadConnector",
    ),
    Component("kv_connector", "UCMConnector", "ascend_dist.kv_offload.vllm_ucm", "UCMConnector"),
    Component(
        "kv_connector", "AscendOffloadingConnector", "ascend_dist.kv_offload.vllm_native", "AscendOffloadingConnector"
    ),
    Component(
        "kv_connector",
        "AscendSimpleCPUOffloadConnector",
        "ascend_dist.kv_offload.vllm_simple",
        "AscendSimpleCPUOffloadConnector",
    ),
    Component("kv_connector", "AscendMultiConnector", "ascend_dist.plugin.multi_connector", "AscendMultiConnector"),
    # RL weight sync, under vllm-ascend's backend names; the trainer side has its own factory.
    Component("weight_transfer", "hccl", "ascend_dist.weight_transfer.vllm_engine", "HCCLWeightTransferEngine"),
    Component("weight_transfer", "npu_ipc", "ascend_dist.weight_transfer.vllm_engine", "NPUIPCWeightTransferEngine"),
    Component(
        "weight_transfer_trainer", "hccl", "ascend_dist.weight_transfer.vllm_trainer", "HCCLTrainerWeightTransferEngine"
    ),
    Component(
        "weight_transfer_trainer",
        "npu_ipc",
        "ascend_dist.weight_transfer.vllm_trainer",
        "NPUIPCTrainerWeightTransferEngine",
    ),
)

# vllm-ascend's configs name these vLLM-owned connectors and mean the Ascend subclasses: a vllm-ascend
# config must select ours (as the kv-mooncake names do), not vLLM's stock classes, which cannot copy
# on an NPU. Replaced only while the entry is vLLM's own (module under `vllm.`); another plugin's is kept.
VLLM_NAME_OVERRIDES: tuple[Component, ...] = (
    Component("kv_connector", "OffloadingConnector", "ascend_dist.kv_offload.vllm_native", "AscendOffloadingConnector"),
    Component(
        "kv_connector",
        "SimpleCPUOffloadConnector",
        "ascend_dist.kv_offload.vllm_simple",
        "AscendSimpleCPUOffloadConnector",
    ),
)

_lock = threading.Lock()
_registered: set[str] = set()
_done = threading.Event()


def _installed(module_path: str) -> bool:
    """Whether `module_path` exists, without importing it or its parent packages.

    `find_spec("a.b.c")` would import `a.b`, and a component's package may import torch; the files of
    the `ascend_dist` namespace portions are looked up directly instead.
    """
    top, _, rest = module_path.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    relative = Path(*rest.split("."))
    for location in spec.submodule_search_locations or ():
        base = Path(location) / relative
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return True
    return False


def _register_one(component: Component) -> None:
    module, cls, method = FACTORIES[component.factory]
    registrar = getattr(getattr(importlib.import_module(module), cls), method)
    try:
        registrar(component.name, component.module, component.class_name)
    except ValueError:
        logger.warning("%s %s is already registered by someone else; keeping theirs", component.factory, component.name)
        return
    _registered.add(f"{component.factory}:{component.name}")


def _registered_module(loader: object) -> str | None:
    """The module path a vLLM factory loader closes over (vLLM's `register_connector` closure), if readable."""
    code = getattr(loader, "__code__", None)
    cells = getattr(loader, "__closure__", None) or ()
    names = getattr(code, "co_freevars", ())
    for name, cell in zip(names, cells, strict=False):
        if name == "module_path" and isinstance(cell.cell_contents, str):
            return cell.cell_contents
    return None


def _override_vllm_name(component: Component) -> None:
    """Point one of vLLM's own connector names at ours, unless someone else replaced vLLM's entry first."""
    module, cls, method = FACTORIES[component.factory]
    factory = getattr(importlib.import_module(module), cls)
    registry = getattr(factory, "_registry", None)
    current = registry.get(component.name) if isinstance(registry, dict) else None
    if current is not None:
        owner = _registered_module(current)
        if owner is None or not owner.startswith("vllm."):
            logger.warning(
                "%s %s is already registered by someone else (%s); keeping theirs",
                component.factory, component.name, owner or "unknown module",
            )  # fmt: skip
            return
        del registry[component.name]  # type: ignore[union-attr]  # vLLM's public API refuses a held name
    getattr(factory, method)(component.name, component.module, component.class_name)
    _registered.add(f"{component.factory}:{component.name}")
    logger.info(
        "%s %s (vllm-ascend's name) selects %s:%s; vLLM's own class stays reachable with kv_connector_module_path",
        component.factory, component.name, component.module, component.class_name,
    )  # fmt: skip


class _ToVllmHandlers(logging.Handler):
    """Hands each record to the handlers the ``vllm`` logger has at that moment.

    Looked up per record, not copied once: vLLM (re)configures its logging in each process, at
    times that differ from when plugins load, and replaces its handlers when it does. Our logger's
    level decides what is written, not theirs (``ASCEND_DIST_LOG_LEVEL=DEBUG`` under vLLM's INFO).
    """

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("vllm").handlers:
            handler.handle(record)


def route_logs_through_vllm() -> bool:
    """Send ``ascend_dist``'s records through vLLM's handlers (its format and stream); True when done.

    Without this they reach no handler in a vLLM process (vLLM configures only its own logger), and
    Python prints bare warnings without time or process and drops everything below. Left alone when
    someone configured ``ascend_dist`` already or ``VLLM_CONFIGURE_LOGGING=0`` (the operator's
    own logging setup decides). The level is ``ASCEND_DIST_LOG_LEVEL`` (ours alone: ``DEBUG``
    adds the connectors' per-read timeline), else ``VLLM_LOGGING_LEVEL``, else INFO.
    """
    ours = logging.getLogger("ascend_dist")
    if ours.handlers or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return False
    ours.addHandler(_ToVllmHandlers())
    if ours.level == logging.NOTSET:
        named = os.environ.get("ASCEND_DIST_LOG_LEVEL") or os.environ.get("VLLM_LOGGING_LEVEL") or "INFO"
        level = logging.getLevelName(named.upper())
        ours.setLevel(level if isinstance(level, int) else logging.INFO)
    ours.propagate = False  # as vLLM's own: a root handler someone adds later would print each twice
    return True


def register() -> None:
    """Register every installed component with vLLM; safe to call any number of times."""
    with _lock:
        if _done.is_set():
            return
        _done.set()
        if not _installed("vllm"):  # only vLLM calls this; without it there is nothing to register with
            logger.debug("vllm is not installed; nothing to register")
            return
        route_logs_through_vllm()
        for component in COMPONENTS:
            if not _installed(component.module):
                continue
            try:
                _register_one(component)
            except Exception:  # never abort vLLM's start-up because of us
                logger.exception("registering %s %s failed; it is unavailable", component.factory, component.name)
        try:
            for name in startup_hooks.arm(startup_hooks.HOOKS, _installed):
                _registered.add(f"startup:{name}")
        except Exception:  # never abort vLLM's start-up because of us
            logger.exception("arming the start-up hooks failed; EPLB stays vLLM's own")
        for component in VLLM_NAME_OVERRIDES:
            if not _installed(component.module):
                continue
            try:
                _override_vllm_name(component)
            except Exception:  # never abort vLLM's start-up because of us
                logger.exception("pointing %s %s at ours failed; vLLM's is kept", component.factory, component.name)


def registered_names() -> frozenset[str]:
    """`factory:name` of everything this process registered (for diagnostics and tests)."""
    return frozenset(_registered)
