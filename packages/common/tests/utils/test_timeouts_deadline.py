"""Transfer-timeout derivation and the injectable-clock Deadline."""

from __future__ import annotations

import pytest

from ascend_dist.common.errors import ConfigError, DeadlineExceeded
from ascend_dist.common.timeouts import Deadline, export_transfer_timeout, transfer_timeout_ms


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, 33064),  # defaults 20 and 7: the "33.06 s" of Mooncake's timeout log
        ({"HCCL_RDMA_TIMEOUT": "20", "HCCL_RDMA_RETRY_CNT": "7"}, 33064),
        ({"HCCL_RDMA_TIMEOUT": "18", "HCCL_RDMA_RETRY_CNT": "3"}, 6221),
        ({"HCCL_RDMA_TIMEOUT": "22"}, int(4.096 * 2**22 * 7 // 1000 + 3000)),
        ({"HCCL_RDMA_RETRY_CNT": "0"}, 3000),
        ({"ASCEND_TRANSFER_TIMEOUT": "5000"}, 5000),
        ({"ASCEND_TRANSFER_TIMEOUT": " 1200 ", "HCCL_RDMA_TIMEOUT": "bogus"}, 1200),  # explicit wins
        ({"ASCEND_TRANSFER_TIMEOUT": "", "HCCL_RDMA_TIMEOUT": ""}, 33064),  # empty = unset
    ],
)
def test_transfer_timeout_ms(env: dict[str, str], expected: int) -> None:
    assert transfer_timeout_ms(env) == expected


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"ASCEND_TRANSFER_TIMEOUT": "abc"}, "ASCEND_TRANSFER_TIMEOUT"),
        ({"ASCEND_TRANSFER_TIMEOUT": "0"}, "ASCEND_TRANSFER_TIMEOUT"),
        ({"ASCEND_TRANSFER_TIMEOUT": "-5"}, "ASCEND_TRANSFER_TIMEOUT"),
        ({"ASCEND_TRANSFER_TIMEOUT": "1_000"}, "ASCEND_TRANSFER_TIMEOUT"),
        ({"HCCL_RDMA_TIMEOUT": "2.5"}, "HCCL_RDMA_TIMEOUT"),
        ({"HCCL_RDMA_TIMEOUT": "64"}, "HCCL_RDMA_TIMEOUT"),
        ({"HCCL_RDMA_RETRY_CNT": "-1"}, "HCCL_RDMA_RETRY_CNT"),
    ],
)
def test_invalid_env_names_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(ConfigError) as info:
        transfer_timeout_ms(env)
    assert info.value.field == variable
    assert variable in str(info.value)


def test_export_writes_the_value_into_the_environment() -> None:
    env = {"HCCL_RDMA_TIMEOUT": "18", "HCCL_RDMA_RETRY_CNT": "3"}
    assert export_transfer_timeout(env) == 6221
    assert env["ASCEND_TRANSFER_TIMEOUT"] == "6221"
    assert transfer_timeout_ms(env) == 6221  # idempotent once exported


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASCEND_TRANSFER_TIMEOUT", "4321")
    assert transfer_timeout_ms() == 4321


def test_deadline_counts_down_on_the_injected_clock() -> None:
    clock = FakeClock()
    deadline = Deadline.after(2.5, clock=clock)
    assert deadline.expires_at == 102.5
    assert deadline.remaining() == 2.5
    assert not deadline.expired()
    deadline.check("pull req-1")
    clock.now = 102.0
    assert deadline.remaining() == pytest.approx(0.5)
    clock.now = 103.0
    assert deadline.remaining() == 0.0
    assert deadline.expired()
    with pytest.raises(DeadlineExceeded, match="pull req-1") as info:
        deadline.check("pull req-1")
    assert isinstance(info.value, TimeoutError)


def test_zero_budget_is_expired_immediately() -> None:
    deadline = Deadline.after(0, clock=FakeClock())
    assert deadline.expired()
    with pytest.raises(DeadlineExceeded, match="handshake"):
        deadline.check("handshake")


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
def test_deadline_rejects_unbounded_or_negative_budgets(seconds: float) -> None:
    with pytest.raises(ConfigError) as info:
        Deadline.after(seconds, clock=FakeClock())
    assert info.value.field == "seconds"


def test_deadline_uses_monotonic_clock_by_default() -> None:
    deadline = Deadline.after(60)
    assert 59 < deadline.remaining() <= 60
    assert "remaining=" in repr(deadline)
