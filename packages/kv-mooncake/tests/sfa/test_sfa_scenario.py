"""The ``pd-sfa`` scenario runs end to end (quick demo) and is registered as an entry point."""

from __future__ import annotations

import importlib.metadata

import pytest

from ascend_dist.common.scenarios import ENTRY_POINT_GROUP, ScenarioContext
from ascend_dist.kv_mooncake._demo.sfa_scenario import make_scenario


class _Progress:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def step(self, message: str) -> None:
        self.steps.append(message)

    def advance(self, done: int, total: int) -> None:
        pass


def test_entry_point_is_registered() -> None:
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert names.get("pd-sfa") == "ascend_dist.kv_mooncake._demo.sfa_scenario:make_scenario"


@pytest.mark.timeout(120)
def test_quick_demo_verifies_every_byte() -> None:
    progress = _Progress()
    report = make_scenario().run(ScenarioContext(mode="demo", progress=progress, quick=True))
    assert report.ok, [c for c in report.checks if not c.ok]
    assert [c.name for c in report.checks][:1] == ["every byte D read equals P's"]
    assert any("bytes verified" in s for s in progress.steps)
