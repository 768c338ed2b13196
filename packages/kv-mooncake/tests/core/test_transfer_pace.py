"""`TransferPace`: how long a read's waiter sleeps before Mooncake's spinning wait."""

from __future__ import annotations

import pytest

from ascend_dist.kv_mooncake.core.transfer_pace import TransferPace

MIB = 1 << 20


def test_a_peer_never_read_from_is_waited_for_at_once() -> None:
    assert TransferPace().sleep_s("p:1", 32 * MIB) == 0.0


def test_the_sleep_is_a_share_of_the_time_at_the_fastest_recent_rate() -> None:
    pace = TransferPace(share=0.5)
    pace.observe("p:1", 32 * MIB, 0.064)  # 2 ms per MiB
    pace.observe("p:1", 32 * MIB, 0.032)  # 1 ms per MiB: the fastest
    pace.observe("p:1", 32 * MIB, 0.128)
    assert pace.sleep_s("p:1", 16 * MIB) == pytest.approx(0.5 * 0.016)
    assert pace.sleep_s("p:2", 16 * MIB) == 0.0  # per peer


def test_reads_expected_shorter_than_the_minimum_are_not_slept_and_long_ones_are_capped() -> None:
    pace = TransferPace(share=1.0, min_sleep_s=0.002, max_sleep_s=0.1)
    pace.observe("p:1", MIB, 0.001)  # 1 ms per MiB
    assert pace.sleep_s("p:1", MIB) == 0.0
    assert pace.sleep_s("p:1", 4 * MIB) == pytest.approx(0.004)
    assert pace.sleep_s("p:1", 1024 * MIB) == 0.1
    assert pace.sleep_s("p:1", 0) == 0.0


def test_small_reads_slow_per_byte_do_not_lengthen_the_sleep_of_large_ones() -> None:
    pace = TransferPace(share=1.0)
    pace.observe("p:1", 32 * MIB, 0.032)
    for _ in range(10):
        pace.observe("p:1", 64 << 10, 0.004)  # fixed cost: 62 ms per MiB
    assert pace.sleep_s("p:1", 32 * MIB) == pytest.approx(0.032)


def test_a_link_that_became_slower_shows_after_a_window_of_reads() -> None:
    pace = TransferPace(share=1.0, window=4)
    pace.observe("p:1", 32 * MIB, 0.032)
    for _ in range(3):
        pace.observe("p:1", 32 * MIB, 0.096)
    assert pace.sleep_s("p:1", 32 * MIB) == pytest.approx(0.032)
    pace.observe("p:1", 32 * MIB, 0.096)  # the fast read left the window
    assert pace.sleep_s("p:1", 32 * MIB) == pytest.approx(0.096)


def test_failed_or_empty_reads_teach_nothing() -> None:
    pace = TransferPace()
    pace.observe("p:1", 0, 0.01)
    pace.observe("p:1", MIB, 0.0)
    assert pace.sleep_s("p:1", 32 * MIB) == 0.0


def test_the_table_forgets_the_peer_heard_from_least_recently() -> None:
    pace = TransferPace(share=1.0, max_peers=2)
    pace.observe("p:1", 32 * MIB, 0.032)
    pace.observe("p:2", 32 * MIB, 0.032)
    pace.observe("p:1", 32 * MIB, 0.032)  # p:1 heard again: p:2 is now the oldest
    pace.observe("p:3", 32 * MIB, 0.032)
    assert pace.sleep_s("p:2", 32 * MIB) == 0.0
    assert pace.sleep_s("p:1", 32 * MIB) > 0 and pace.sleep_s("p:3", 32 * MIB) > 0
