"""`AuthCost`: a thread-safe account of authentication work."""

from __future__ import annotations

import threading
import time

from ascend_dist.common.auth_cost import AuthCost, AuthCostSnapshot


def test_operations_and_time_add_up_across_threads() -> None:
    cost = AuthCost()
    assert cost.snapshot() == AuthCostSnapshot(0, 0)

    def work() -> None:
        for _ in range(500):
            cost.add(cost.start())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert cost.snapshot().ops == 2000


def test_a_snapshot_difference_is_what_was_spent_between() -> None:
    cost = AuthCost()
    cost.add(cost.start())
    before = cost.snapshot()
    started = cost.start()
    time.sleep(0.01)
    cost.add(started)
    spent = cost.snapshot().since(before)
    assert spent.ops == 1
    assert spent.ns >= 10_000_000
