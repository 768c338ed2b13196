"""Start-up hooks: a component function run once the vLLM module it patches is imported, never before.

Runs in: every vLLM process, installed by `register()`. The plugin must import nothing heavy (no
torch, no component), yet eplb-ascend's hooks wrap functions of ``vllm.distributed.eplb``: a
post-import hook on ``sys.meta_path`` waits for that module and runs the component's ``install``
right after the module executed (at once when it is already imported). A hook that raises is logged
and leaves vLLM as it is: an exception here would abort vLLM's start-up.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["HOOKS", "StartupHook", "arm", "ran"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartupHook:
    """Run ``module:function`` (a component's) once vLLM module ``after`` is imported."""

    name: str
    after: str
    module: str
    function: str


HOOKS: tuple[StartupHook, ...] = (
    # EPLB at start-up: vLLM's communicator factory and async layer commit (eplb-ascend's vllm_install)
    StartupHook("eplb", "vllm.distributed.eplb.eplb_state", "ascend_dist.eplb_ascend.vllm_install", "install"),
)

_lock = threading.Lock()
_ran: dict[str, str] = {}


def _run(hook: StartupHook) -> None:
    with _lock:
        if hook.name in _ran:
            return
        _ran[hook.name] = "running"
    try:
        result = getattr(importlib.import_module(hook.module), hook.function)()
        _ran[hook.name] = f"ok: {result}"
        logger.info("start-up hook %s ran after %s: %s", hook.name, hook.after, result)
    except Exception as exc:  # never abort vLLM because of us
        _ran[hook.name] = f"failed: {type(exc).__name__}: {exc}"
        logger.exception("start-up hook %s failed; vLLM's %s is left as it is", hook.name, hook.after)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the hooks waiting for it."""

    def __init__(self, inner: importlib.abc.Loader, hooks: Sequence[StartupHook]) -> None:
        self._inner, self._hooks = inner, hooks

    def __getattr__(self, name: str) -> Any:
        # get_source, get_code, get_filename, is_package, resource readers: the module's own loader answers
        return getattr(self._inner, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for hook in self._hooks:
            _run(hook)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a watched module found by the finders after it."""

    def __init__(self, hooks: Sequence[StartupHook]) -> None:
        self._hooks = hooks

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        hooks = [h for h in self._hooks if h.after == fullname and h.name not in _ran]
        if not hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, hooks)
                return spec
        return None


def arm(hooks: Sequence[StartupHook], installed: Any) -> list[str]:
    """Arm every hook whose component module is ``installed(module)``; returns their names.

    A hook whose vLLM module is already imported runs now.
    """
    armed = [h for h in hooks if installed(h.module)]
    waiting = []
    for hook in armed:
        if hook.after in sys.modules:
            _run(hook)
        else:
            waiting.append(hook)
    if waiting:
        sys.meta_path.insert(0, _Finder(waiting))
    return [h.name for h in armed]


def ran() -> dict[str, str]:
    """Each hook that ran: ``ok: <what it returned>`` or ``failed: <error>`` (for doctor and tests)."""
    return dict(_ran)
