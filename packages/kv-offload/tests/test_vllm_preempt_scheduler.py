"""`PreemptSavingScheduler`'s hook call, over fakes of the connector and the block manager (nox session vllm).

The save-and-restore cycle itself runs inside vLLM's real Scheduler in `test_vllm_scheduler_loop`
and in a real engine in the engine tier (`tests/engine/test_offload.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from ascend_dist.kv_offload import vllm_preempt_scheduler  # noqa: E402


@dataclass
class FakeRequest:
    request_id: str
    num_computed_tokens: int


@dataclass
class FakeBlocks:
    """The one call the scheduler makes on vLLM's KV cache manager before a preemption."""

    ids: dict[str, tuple[list[int], ...]]

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.ids[request_id]


@dataclass
class SavingConnector:
    answer: bool = True
    calls: list[tuple[str, tuple[list[int], ...], int]] = field(default_factory=list)

    def update_state_before_preempt(self, request: Any, block_ids: Any, num_computed_tokens: int) -> bool:
        self.calls.append((request.request_id, block_ids, num_computed_tokens))
        return self.answer


class BrokenConnector:
    def update_state_before_preempt(self, request: Any, block_ids: Any, num_computed_tokens: int) -> bool:
        raise RuntimeError("host pool unavailable")


class Probe(vllm_preempt_scheduler.PreemptSavingMixin):
    """The mixin alone, over fakes (vLLM's Scheduler needs a whole engine config)."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector
        self.kv_cache_manager = FakeBlocks({"r1": ([3, 4, 5],)})


def test_the_connector_gets_the_requests_blocks_and_computed_tokens() -> None:
    connector = SavingConnector()
    assert Probe(connector)._save_before_preempt(FakeRequest("r1", 80)) is True
    assert connector.calls == [("r1", ([3, 4, 5],), 80)]


def test_a_refused_save_means_recompute() -> None:
    assert Probe(SavingConnector(answer=False))._save_before_preempt(FakeRequest("r1", 80)) is False


@pytest.mark.parametrize("connector", [None, object()], ids=["no connector", "connector without the hook"])
def test_without_the_hook_nothing_is_saved(connector: Any) -> None:
    assert Probe(connector)._save_before_preempt(FakeRequest("r1", 80)) is False


def test_a_failing_save_is_logged_and_recomputed_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    assert Probe(BrokenConnector())._save_before_preempt(FakeRequest("r1", 80)) is False
    assert "saving the KV of preempted request r1 failed" in caplog.text


def test_both_schedulers_are_vllms_with_the_hook() -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert issubclass(vllm_preempt_scheduler.PreemptSavingScheduler, Scheduler)
    assert issubclass(vllm_preempt_scheduler.AsyncPreemptSavingScheduler, AsyncScheduler)
