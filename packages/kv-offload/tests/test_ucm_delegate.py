"""UCM wrapper delegation rules with three fake dispatchers (no UCM, no vLLM needed)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from ascend_dist.kv_offload.ucm import INSTALL_HINT, UcmDelegate, UcmUnavailable, load_dispatcher_class


class Base:
    """Stands in for KVConnectorBase_V1: inherited no-ops."""

    def shutdown(self) -> str:
        return "base-noop"

    def take_events(self) -> Any:
        return None


class Inner:
    def shutdown(self) -> str:
        return "inner"

    def take_events(self) -> tuple[str, ...]:
        return ("e1",)


class OwnHook(Base):
    """Defines the reserved hook itself."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        self.args = (vllm_config, role, kv_cache_config)
        self.connector = Inner()

    def shutdown(self) -> str:
        return "own"

    def get_finished(self, ids: set[str]) -> tuple[set[str], None]:
        return ids, None

    def request_finished(self, req: str, ids: list[int]) -> tuple[bool, None]:
        return bool(ids), None


class InnerOnly(Base):
    """Two-argument constructor (older UCM); the real hook lives on `.connector`."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        self.connector = Inner()

    def request_finished(self, req: str, ids: list[int]) -> tuple[bool, None]:
        return False, None


class Neither(Base):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        self.handle_preemptions = 42  # not callable


def test_own_class_hook_wins_and_core_hooks_delegate() -> None:
    d = UcmDelegate(OwnHook, "cfg", "role", "kvcfg")
    assert d.dispatcher.args == ("cfg", "role", "kvcfg")
    assert d.reserved("shutdown") == "own"
    assert d.take_events() == ("e1",)  # not defined on OwnHook itself: the inner one
    assert d.core("get_finished", {"a"}) == ({"a"}, None)
    with pytest.raises(AttributeError):
        d.core("shutdown")


def test_inner_connector_used_when_dispatcher_only_inherits() -> None:
    d = UcmDelegate(InnerOnly, "cfg", "role", "kvcfg")  # falls back to two arguments
    assert d.reserved("shutdown") == "inner"
    assert d.request_finished_all_groups("r", [[1, 2]]) == (False, None)
    with pytest.raises(UcmUnavailable, match="2 groups"):
        d.request_finished_all_groups("r", [[1], [2]])


def test_inherited_or_missing_hooks() -> None:
    d = UcmDelegate(Neither, "cfg", "role", "kvcfg")
    assert d.reserved("shutdown") == "base-noop"
    assert d.reserved("handle_preemptions") is None  # non-callable
    assert d.reserved("reset_cache") is None  # missing
    assert d.take_events() == ()


def test_missing_ucm_raises_a_typed_error_with_install_instructions() -> None:
    def importer(name: str) -> types.ModuleType:
        raise ModuleNotFoundError(f"No module named {name!r}")

    with pytest.raises(UcmUnavailable, match="uc-manager-cann") as info:
        load_dispatcher_class(importer=importer)
    assert isinstance(info.value, ImportError) and INSTALL_HINT in str(info.value)
    fake = types.ModuleType("fake_ucm")
    fake.UCMConnector = OwnHook  # type: ignore[attr-defined]
    assert load_dispatcher_class("fake_ucm", importer=lambda _: fake) is OwnHook
    with pytest.raises(UcmUnavailable, match="not a class"):
        load_dispatcher_class("fake_ucm", "Nope", importer=lambda _: fake)
