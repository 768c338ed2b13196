"""Helpers shared by the synthetic instances (`synthetic`, `layerwise.synthetic`, `sfa.synthetic`).

Runs in: the scenarios, the tests and the P child processes. Pure Python: vLLM's aggregation of
per-rank reports and a deadline-bounded wait for received requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from ascend_dist.common.errors import DeadlineExceeded

__all__ = ["aggregate_ranks", "wait_received"]


def aggregate_ranks(seen: dict[str, int], reports: Iterable[set[str]], ranks: int) -> set[str]:
    """Requests every one of ``ranks`` ranks has now reported (as vLLM aggregates workers' reports).

    Args:
        seen: Reports counted so far per request; updated (a completed request is removed).
        reports: This round's report of each rank.
        ranks: How many ranks must report a request.
    """
    done: set[str] = set()
    for report in reports:
        for rid in report:
            seen[rid] = seen.get(rid, 0) + 1
            if seen[rid] == ranks:
                done.add(rid)
                del seen[rid]
    return done


def wait_received(
    poll: Callable[[], tuple[set[str], set[int]]], rids: set[str], timeout_s: float, interval_s: float = 0.001
) -> set[int]:
    """Call ``poll`` (``(received, load-error block ids)``) until every request in ``rids`` was received.

    Returns:
        The load-error block ids seen meanwhile.

    Raises:
        DeadlineExceeded: Some request was not received within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pending, errors = set(rids), set[int]()
    while pending:
        done, errs = poll()
        errors |= errs
        pending -= done
        if pending and time.monotonic() > deadline:
            raise DeadlineExceeded(f"requests {sorted(pending)[:4]} not received within {timeout_s} s")
        if pending:
            time.sleep(interval_s)
    return errors
