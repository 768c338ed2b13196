"""Composition rules of the multi-connector (`_multi_rules`), with fakes of its own protocols; no vLLM."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from ascend_dist.plugin._multi_rules import (
    AllocPlan,
    Composition,
    ExtraSaves,
    merge_finished_params,
    merge_transfer_results,
)


@dataclass
class Req:
    request_id: str


@dataclass
class FakeChild:
    """A `Child`: answers from a table, records every call into a shared log."""

    name: str
    log: list[str]
    answers: dict[str, tuple[int | None, bool]] = field(default_factory=dict)
    errors: set[int] = field(default_factory=set)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.log.append(f"{self.name}-match")
        return self.answers.get(request.request_id, (0, False))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.log.append(f"{self.name}-load")

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.log.append(f"{self.name}-save")

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self.errors)


@dataclass
class FakePreempt(FakeChild):
    """Also a `PreemptAware` child (the recompute-offload connector's shape)."""

    preempted: set[str] = field(default_factory=set)

    def has_preempted_request(self, req_id: str) -> bool:
        return req_id in self.preempted

    def update_state_before_preempt(self, request: Any, block_ids: Any, num_computed_tokens: int) -> bool:
        self.preempted.add(request.request_id)
        return True


@dataclass
class FakeProvider(FakeChild):
    """A layer-wise push producer: `ReuseProvider` and `KvWrittenHook`."""

    def wait_for_layer_reuse(self, layer_name: str) -> None:
        self.log.append(f"{self.name}-reuse:{layer_name}")

    def on_kv_cache_written(self, layer_name: str) -> None:
        self.log.append(f"{self.name}-written")


@dataclass
class FakeSink(FakeChild):
    """A store connector: `ReleaseWaiterSink`, `KvWrittenHook`, `MambaCopyHooks`; its load calls the waiter."""

    accept: bool | None = True
    waiter: Callable[[str], None] | None = None

    def set_external_slot_release_waiter(self, waiter: Callable[[str], None]) -> bool | None:
        self.waiter = waiter
        return self.accept

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.waiter is not None:
            self.waiter(layer_name)
        self.log.append(f"{self.name}-load")

    def on_kv_cache_written(self, layer_name: str) -> None:
        self.log.append(f"{self.name}-written")

    def prepare_mamba_state_copy(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append(f"{self.name}-mprep{args}")
        return self.name

    def finish_mamba_state_copy(self, *args: Any, **kwargs: Any) -> Any:
        self.log.append(f"{self.name}-mfin")
        return self.name


def test_first_child_with_tokens_loads_and_every_child_is_asked() -> None:
    log: list[str] = []
    a = FakeChild("a", log)
    b = FakeChild("b", log, answers={"r": (32, True)})
    c = FakeChild("c", log, answers={"r": (64, False)})
    comp = Composition([a, b, c], [False] * 3, [False] * 3)
    assert comp.get_num_new_matched_tokens(Req("r"), 0) == (32, True)
    assert comp.chosen == {"r": 1} and log == ["a-match", "b-match", "c-match"]
    assert comp.get_num_new_matched_tokens(Req("none"), 0) == (0, False) and "none" not in comp.chosen


def test_a_child_still_looking_up_makes_the_answer_none() -> None:
    log: list[str] = []
    a = FakeChild("a", log, answers={"r": (None, False)})
    b = FakeChild("b", log, answers={"r": (16, True)})
    comp = Composition([a, b], [False, False], [False, False])
    assert comp.get_num_new_matched_tokens(Req("r"), 0) == (None, False)
    assert log == ["a-match"] and comp.chosen == {}


def test_preempted_holder_answers_before_first_match() -> None:
    log: list[str] = []
    pd = FakeChild("pd", log, answers={"r": (48, True)})
    rec = FakePreempt("rec", log, answers={"r": (40, True)})
    comp = Composition([pd, rec], [False, False], [False, False])
    assert comp.update_state_before_preempt(Req("r"), [[1, 2]], 40)
    assert comp.get_num_new_matched_tokens(Req("r"), 0) == (40, True) and comp.chosen["r"] == 1
    assert log == ["rec-match"]
    rec.answers["r"] = (None, False)  # its store is still pending: ask again later
    assert comp.get_num_new_matched_tokens(Req("r"), 0) == (None, False)
    rec.answers["r"] = (0, False)  # nothing saved after all: fall back to first match
    comp.forget("r")
    assert comp.get_num_new_matched_tokens(Req("r"), 0) == (48, True) and comp.chosen["r"] == 0


def test_update_before_preempt_false_without_preempt_aware_children() -> None:
    comp = Composition([FakeChild("a", [])], [False], [False])
    assert comp.update_state_before_preempt(Req("r"), [[1]], 16) is False


def test_alloc_plan_real_blocks_only_for_loader_and_full_block_children() -> None:
    log: list[str] = []
    kids = [FakeChild("store", log, answers={"r": (16, False)}), FakeChild("pd", log), FakeChild("lw", log)]
    comp = Composition(kids, [False] * 3, [False, False, True], others_get_real_blocks=False)
    comp.get_num_new_matched_tokens(Req("r"), 0)
    assert comp.alloc_plan("r", 16) == [AllocPlan(True, 16), AllocPlan(False, 0), AllocPlan(True, 16)]
    assert comp.alloc_plan("other", 0) == [AllocPlan(False, 0), AllocPlan(False, 0), AllocPlan(True, 0)]


def test_alloc_plan_default_shows_non_loaders_the_real_blocks_with_zero_tokens() -> None:
    kids = [FakeChild("pd", [], answers={"r": (16, True)}), FakeChild("offload", [])]
    comp = Composition(kids, [False, False], [False, False])
    comp.get_num_new_matched_tokens(Req("r"), 0)
    assert comp.alloc_plan("r", 16) == [AllocPlan(True, 16), AllocPlan(True, 0)]


def test_trait_lists_must_match_children() -> None:
    with pytest.raises(ValueError, match="one entry per child"):
        Composition([FakeChild("a", [])], [False, False], [False])
    with pytest.raises(ValueError, match="wait_for_layer_reuse"):
        Composition([FakeChild("a", [])], [True], [False])


def test_at_most_one_child_returns_kv_transfer_params() -> None:
    assert merge_finished_params([(True, None), (False, {"remote": 1}), (True, None)]) == (2, {"remote": 1})
    assert merge_finished_params([(False, None), (False, None)]) == (0, None)
    with pytest.raises(RuntimeError, match=r"children \[0, 2\]"):
        merge_finished_params([(False, {"a": 1}), (False, None), (True, {"b": 2})])


def test_send_finished_only_after_every_delaying_child_reported() -> None:
    sched, worker = ExtraSaves(), ExtraSaves()
    _, _ = merge_finished_params([(True, None), (True, {"x": 1}), (True, None)])
    sched.record("r", 3)
    sched.record("single", 1)
    shipped = sched.take()
    assert shipped == {"r": 2} and sched.take() is None
    worker.absorb(shipped)
    step1 = merge_transfer_results([({"r", "single"}, {"d"}, set()), (set(), {"e"}, {"e"})], worker)
    assert step1 == ({"single"}, {"d", "e"}, {"e"})
    assert merge_transfer_results([({"r"}, set(), set())], worker) == (set(), set(), set())
    assert merge_transfer_results([({"r"}, set(), set())], worker) == ({"r"}, set(), set())
    assert worker.pending == {}


def test_load_errors_are_unioned() -> None:
    kids = [FakeChild("a", [], errors={1, 2}), FakeChild("b", [], errors={2, 9}), FakeChild("c", [])]
    assert Composition(kids, [False] * 3, [False] * 3).get_block_ids_with_load_errors() == {1, 2, 9}


def test_layer_order_with_sink_matches_upstream_sequence() -> None:
    """Store (sink) + layer-wise P (provider): store-load, pd-save, store-save, pd-written, store-written."""
    log: list[str] = []
    store = FakeSink("store", log)
    pd = FakeProvider("pd", log)
    comp = Composition([store, pd], [False, True], [False, True])
    assert comp.configure_layerwise_reuse_completion() and comp.sink_configured
    comp.wait_for_layer_load("L0")
    comp.save_kv_layer("L0", None, None)
    comp.on_kv_cache_written("L0")
    assert log == ["pd-reuse:L0", "store-load", "pd-save", "store-save", "pd-written", "store-written"]


def test_layer_order_without_sink_calls_providers_first() -> None:
    log: list[str] = []
    store = FakeSink("store", log, accept=False)
    plain = FakeChild("plain", log)
    pd = FakeProvider("pd", log)
    comp = Composition([store, plain, pd], [False, False, True], [False] * 3)
    assert not comp.configure_layerwise_reuse_completion()
    store.waiter = None  # declined: it must not call it
    comp.wait_for_layer_load("L1")
    comp.save_kv_layer("L1", None, None)
    assert log == ["pd-load", "store-load", "plain-load", "pd-save", "store-save", "plain-save"]


def test_no_providers_offers_no_waiter() -> None:
    store = FakeSink("store", [])
    comp = Composition([store], [False], [False])
    assert not comp.configure_layerwise_reuse_completion() and store.waiter is None
    assert comp.load_order() == comp.save_order() == [0]


def test_mamba_copy_hooks_forwarded_prepare_in_order_finish_reversed() -> None:
    log: list[str] = []
    s1, plain, s2 = FakeSink("s1", log), FakeChild("plain", log), FakeSink("s2", log)
    comp = Composition([s1, plain, s2], [False] * 3, [False] * 3)
    assert comp.prepare_mamba_state_copy(7) == ["s1", "s2"]
    assert comp.finish_mamba_state_copy() == ["s2", "s1"]
    assert log == ["s1-mprep(7,)", "s2-mprep(7,)", "s2-mfin", "s1-mfin"]


def test_providers_known_only_after_registration_are_picked_up() -> None:
    log: list[str] = []
    store, pd = FakeSink("store", log), FakeProvider("pd", log)
    comp = Composition([store, pd], [False, False], [False, False])
    assert not comp.configure_layerwise_reuse_completion()
    comp.wait_for_layer_load("L0")
    assert log == ["store-load", "pd-load"]
    comp.set_reuse_providers([False, True])
    assert comp.configure_layerwise_reuse_completion()
    log.clear()
    comp.wait_for_layer_load("L1")
    assert log == ["pd-reuse:L1", "store-load"]
    with pytest.raises(ValueError, match="wait_for_layer_reuse"):
        comp.set_reuse_providers([True, False])
    with pytest.raises(ValueError, match="one entry per child"):
        comp.set_reuse_providers([True])
