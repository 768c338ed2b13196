"""Delegation rules of the UCM connector wrapper; no vLLM import.

Runs in: the scheduler and worker processes, inside the ``UCMConnector`` adapter (`vllm_ucm`).

All data movement is the UCM package's (``uc-manager``); the wrapper only delegates. Core hooks go
straight to UCM's dispatcher. "Reserved" hooks (``shutdown``, ``handle_preemptions``, ...) go to the
dispatcher only when its own class defines them; otherwise to its inner ``connector`` when it has
one (the dispatcher's inherited base-class no-ops would hide the real implementation); otherwise to
the inherited method; a missing or non-callable hook returns None.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Final

from ascend_dist.common.errors import AscendDistError

__all__ = [
    "CORE_HOOKS",
    "DEFAULT_UCM_CLASS",
    "DEFAULT_UCM_MODULE",
    "INSTALL_HINT",
    "RESERVED_HOOKS",
    "UcmDelegate",
    "UcmUnavailable",
    "load_dispatcher_class",
]

logger = logging.getLogger(__name__)

DEFAULT_UCM_MODULE: Final = "ucm.integration.vllm.ucm_connector"
DEFAULT_UCM_CLASS: Final = "UCMConnector"
INSTALL_HINT: Final = (
    "install the UCM wheel built for your CANN version and SoC, e.g. "
    "`pip install uc-manager-cann910-a3` (variants: uc-manager-cann{900,901,910,920}-{a2,a3,a5}), "
    "or set kv_connector_extra_config.ucm_module_path to the module holding UCM's connector"
)

CORE_HOOKS: Final = frozenset(
    {
        "register_kv_caches", "has_connector_metadata", "bind_connector_metadata", "clear_connector_metadata",
        "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_block_ids_with_load_errors",
        "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
        "get_finished", "update_connector_output",
    }
)  # fmt: skip
RESERVED_HOOKS: Final = frozenset(
    {
        "shutdown", "set_host_xfer_buffer_ops", "handle_preemptions", "build_connector_worker_meta", "take_events",
        "get_kv_connector_stats", "get_kv_connector_kv_cache_events", "get_handshake_metadata",
        "set_xfer_handshake_metadata", "get_finished_count", "reset_cache",
    }
)  # fmt: skip


class UcmUnavailable(AscendDistError, ImportError):
    """The UCM package (``uc-manager``) is not installed or lacks its vLLM connector."""


def load_dispatcher_class(
    module_path: str = DEFAULT_UCM_MODULE,
    class_name: str = DEFAULT_UCM_CLASS,
    importer: Callable[[str], ModuleType] = importlib.import_module,
) -> type:
    """Import UCM's connector class.

    Raises:
        UcmUnavailable: the module cannot be imported or lacks the class; the message says how to
            install UCM.
    """
    try:
        module = importer(module_path)
    except ImportError as exc:
        raise UcmUnavailable(f"UCMConnector needs UCM ({module_path!r} not importable: {exc}); {INSTALL_HINT}") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise UcmUnavailable(f"{module_path}.{class_name} is not a class; {INSTALL_HINT}")
    return cls


class UcmDelegate:
    """Forwards hooks to one UCM dispatcher by the rules in the module docstring."""

    def __init__(self, dispatcher_cls: type, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        """Build the dispatcher with three arguments, or two for UCM releases that take two."""
        try:
            self.dispatcher: Any = dispatcher_cls(vllm_config, role, kv_cache_config)
        except TypeError as exc:
            logger.info("UCM dispatcher takes (vllm_config, role) only (%s); retrying with two arguments", exc)
            self.dispatcher = dispatcher_cls(vllm_config, role)

    def core(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call a core hook on the dispatcher.

        Raises:
            AttributeError: ``name`` is not a core hook (a wiring bug).
        """
        if name not in CORE_HOOKS:
            raise AttributeError(f"{name} is not a core UCM hook")
        return getattr(self.dispatcher, name)(*args, **kwargs)

    def reserved_target(self, name: str) -> Callable[..., Any] | None:
        """The callable a reserved hook resolves to, or None."""
        if name not in RESERVED_HOOKS:
            raise AttributeError(f"{name} is not a reserved UCM hook")
        dispatcher = self.dispatcher
        owner: Any = dispatcher
        if name not in type(dispatcher).__dict__:
            inner = getattr(dispatcher, "connector", None)
            if inner is not None:
                owner = inner
        target = getattr(owner, name, None)
        return target if callable(target) else None

    def reserved(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call a reserved hook (None when it resolves to nothing)."""
        target = self.reserved_target(name)
        return None if target is None else target(*args, **kwargs)

    def take_events(self) -> Any:
        """Reserved ``take_events``; an empty tuple when it resolves to nothing or returns None."""
        events = self.reserved("take_events")
        return () if events is None else events

    def request_finished_all_groups(self, request: Any, block_ids: Sequence[Sequence[int]]) -> Any:
        """The all-groups hook, or ``request_finished(req, block_ids[0])`` for single-group models.

        Raises:
            UcmUnavailable: a multi-group model with a UCM release lacking the all-groups hook.
        """
        hook = getattr(self.dispatcher, "request_finished_all_groups", None)
        if callable(hook):
            return hook(request, block_ids)
        if len(block_ids) != 1:
            raise UcmUnavailable(f"this UCM release has no request_finished_all_groups for {len(block_ids)} groups")
        return self.dispatcher.request_finished(request, block_ids[0])
