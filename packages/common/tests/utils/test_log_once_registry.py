"""log_once: first occurrence only, per logger and key, thread-safe, bounded memory."""

from __future__ import annotations

import logging
import threading
import uuid

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.log import OnceRegistry, log_once


def fresh_logger() -> logging.Logger:
    # A unique name per test: the module-level registry is process-wide.
    return logging.getLogger(f"ascend_dist.test.log_once.{uuid.uuid4().hex}")


def test_logs_first_time_only(caplog: pytest.LogCaptureFixture) -> None:
    log = fresh_logger()
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert log_once(log, logging.WARNING, "slow peer %s", "a") is True
        assert log_once(log, logging.WARNING, "slow peer %s", "b") is False  # key = msg by default
    assert [r.getMessage() for r in caplog.records] == ["slow peer a"]
    assert caplog.records[0].levelno == logging.WARNING


def test_explicit_key_logs_once_per_key(caplog: pytest.LogCaptureFixture) -> None:
    log = fresh_logger()
    with caplog.at_level(logging.INFO, logger=log.name):
        for host in ["a", "b", "a", "b", "c"]:
            log_once(log, logging.INFO, "slow peer %s", host, key=("slow", host))
    assert [r.getMessage() for r in caplog.records] == ["slow peer a", "slow peer b", "slow peer c"]


def test_keys_are_per_logger(caplog: pytest.LogCaptureFixture) -> None:
    first, second = fresh_logger(), fresh_logger()
    with caplog.at_level(logging.INFO):
        assert log_once(first, logging.INFO, "same text")
        assert log_once(second, logging.INFO, "same text")
    assert len(caplog.records) == 2


def test_disabled_level_is_not_remembered(caplog: pytest.LogCaptureFixture) -> None:
    log = fresh_logger()
    log.setLevel(logging.WARNING)
    assert log_once(log, logging.DEBUG, "detail") is False
    log.setLevel(logging.DEBUG)
    with caplog.at_level(logging.DEBUG, logger=log.name):
        assert log_once(log, logging.DEBUG, "detail") is True
    assert [r.getMessage() for r in caplog.records] == ["detail"]


def test_record_points_at_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    log = fresh_logger()
    with caplog.at_level(logging.INFO, logger=log.name):
        log_once(log, logging.INFO, "where")
    assert caplog.records[0].funcName == "test_record_points_at_the_caller"


def test_registry_is_lru_bounded(caplog: pytest.LogCaptureFixture) -> None:
    registry, log = OnceRegistry(capacity=2), fresh_logger()
    with caplog.at_level(logging.INFO, logger=log.name):
        assert registry.log(log, logging.INFO, "a")
        assert registry.log(log, logging.INFO, "b")
        assert not registry.log(log, logging.INFO, "a")  # refreshes "a"
        assert registry.log(log, logging.INFO, "c")  # evicts "b", the least recently seen
        assert len(registry) == 2
        assert not registry.log(log, logging.INFO, "a")
        assert registry.log(log, logging.INFO, "b")  # forgotten, so logged again
    assert [r.getMessage() for r in caplog.records] == ["a", "b", "c", "b"]


def test_concurrent_callers_log_exactly_once(caplog: pytest.LogCaptureFixture) -> None:
    log, registry = fresh_logger(), OnceRegistry()
    results: list[bool] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait(timeout=5)
        got = [registry.log(log, logging.INFO, "race %d", i, key="race") for i in range(50)]
        with lock:
            results.extend(got)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    with caplog.at_level(logging.INFO, logger=log.name):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert results.count(True) == 1
    assert len(caplog.records) == 1


@pytest.mark.parametrize("capacity", [0, -1, True])
def test_registry_rejects_bad_capacity(capacity: int) -> None:
    with pytest.raises(ConfigError):
        OnceRegistry(capacity)
