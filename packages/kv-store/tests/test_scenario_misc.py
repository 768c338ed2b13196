"""The ``pool`` scenario in demo mode, block-id bounds, and the unavailable-backend stand-in."""

from __future__ import annotations

import logging

import pytest

from ascend_dist.common.errors import BlockIdError, StoreError
from ascend_dist.common.scenarios import ScenarioContext
from ascend_dist.kv_store import PoolConfig, PoolSpec, build_scheduler, build_worker
from ascend_dist.kv_store._demo.scenario import make_scenario
from ascend_dist.kv_store.backends.factory import UnavailableBackend, create_backend_or_unavailable

pytestmark = pytest.mark.mooncake


class _Progress:
    def __init__(self) -> None:
        self.steps: list[str] = []

    def step(self, message: str) -> None:
        self.steps.append(message)

    def advance(self, done: int, total: int) -> None:
        pass


def test_pool_demo_scenario_verifies_every_byte() -> None:
    progress = _Progress()
    report = make_scenario().run(ScenarioContext(mode="demo", progress=progress, quick=True, repeat=1))
    assert report.ok, report.checks
    assert [c.name for c in report.checks] == [
        "every loaded byte equals instance A's block",
        "hit rate equals the reusable whole-chunk fraction",
        "GVA layer-wise: every layer of every block loaded byte-exact",
    ]
    assert not report.measurements and progress.steps


def test_pool_quick_bench_checks_every_round_and_reports_baselines() -> None:
    report = make_scenario().run(ScenarioContext(mode="bench", progress=_Progress(), quick=True, repeat=1))
    assert report.ok, [c for c in report.checks if not c.ok]
    names = [c.name for c in report.checks]
    assert sum(n.startswith("pool round") for n in names) == 4 and sum(n.startswith("raw round") for n in names) == 4
    assert sum(n.startswith("pool layer-wise round") for n in names) == 4
    assert "the RPC path went over the RPC" in names
    figures = {m.name: m for m in report.measurements}
    assert len(figures) == 4 and all(m.value > 0 and m.baseline > 0 for m in figures.values())
    assert [m.target_ratio for m in figures.values()] == [0.85, None, None, None]


def test_block_ids_outside_the_cache_are_refused(kvtools) -> None:
    from ascend_dist.kv_store import InMemoryBackend

    spec = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2)
    worker = build_worker(spec, PoolConfig.from_extra({}), InMemoryBackend())
    try:
        worker.register_kv_caches(kvtools.make(num_blocks=4), 4)
        db = spec.token_db()
        db.set_buffers(0, worker._db.buffers(0))
        assert db.prepare_value(0, 16, [3])[2] == 3
        with pytest.raises(BlockIdError, match="block_id"):
            db.prepare_value(0, 16, [4])
    finally:
        worker.close()


def test_unreachable_yuanrong_runs_with_zero_hits(kvtools, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="ascend_dist.kv_store"):
        backend = create_backend_or_unavailable(
            "yuanrong", backend_config={"worker_addr": f"127.0.0.1:{kvtools.free_port()}", "connect_timeout_ms": 300}
        )
    assert isinstance(backend, UnavailableBackend)
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    spec = PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2)
    worker = build_worker(spec, PoolConfig.from_extra({"backend": "yuanrong"}), backend)
    try:
        scheduler = build_scheduler(spec, PoolConfig.from_extra({}), worker.safe_lookup)
        assert scheduler.get_num_new_matched_tokens("r", list(range(64)), 64, 0) == (0, False)
        with pytest.raises(StoreError, match="unavailable since start-up"):
            backend.get(["k"], [[0]], [[1]])
    finally:
        worker.close()
