"""D's per-peer lanes (`pull/lanes.py`): the breaker's moves with an injected clock, and lane reuse."""

from __future__ import annotations

import threading

from ascend_dist.kv_mooncake.pull.lanes import Lane, Lanes


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_on_failure_probes_after_retry_s_and_closes_on_an_answer() -> None:
    clock = Clock()
    lane = Lane(("P", "127.0.0.1", 1), 1, 2.0, clock)
    try:
        a, b, c, d = object(), object(), object(), object()
        assert lane.admit(a) and not lane.is_open  # closed: everyone passes
        lane.failed(a)
        assert lane.is_open and not lane.admit(b) and not lane.passes(b)  # open: fail fast
        clock.now = 2.5
        assert lane.admit(c)  # half-open: c probes
        assert not lane.admit(d) and lane.passes(c) and not lane.passes(d)  # the others still fail fast
        lane.failed(c)  # the probe failed: open again for retry_s
        assert not lane.admit(d)
        clock.now = 4.0
        assert not lane.admit(d)
        clock.now = 4.6
        assert lane.admit(d)
        lane.answered(d)
        assert not lane.is_open and lane.admit(b)
    finally:
        lane.close()


def test_a_probe_that_times_out_reopens_and_an_unrelated_timeout_does_not_open() -> None:
    clock = Clock()
    lane = Lane(("P", "127.0.0.1", 1), 1, 1.0, clock)
    try:
        slow, probe = object(), object()
        assert lane.admit(slow)
        lane.expired(slow)  # a closed lane's timed-out request: P may just be slow
        assert not lane.is_open
        lane.failed(slow)
        clock.now = 1.5
        assert lane.admit(probe)
        lane.expired(probe)  # the probe never ended: P did not answer it
        assert lane.is_open and not lane.admit(object())
    finally:
        lane.close()


def test_a_probe_released_without_a_verdict_hands_the_probe_to_the_next_request() -> None:
    clock = Clock()
    lane = Lane(("P", "127.0.0.1", 1), 1, 1.0, clock)
    try:
        first, empty, probe, other = object(), object(), object(), object()
        assert lane.admit(first)
        lane.failed(first)
        clock.now = 1.5
        assert lane.admit(empty)  # it probes, but ends without asking P (nothing to read)
        assert not lane.admit(other)
        lane.release(empty)
        assert lane.admit(probe) and not lane.passes(other)  # still half-open: the next one probes
        lane.release(other)  # not the probe: changes nothing
        assert lane.passes(probe) and not lane.admit(other)
        lane.answered(probe)
        assert not lane.is_open and lane.admit(other)
    finally:
        lane.close()


def test_lanes_are_per_peer_and_idle_ones_are_closed_beyond_the_cap() -> None:
    lanes = Lanes(2, 1.0)
    try:
        first = lanes.get(("P0", "127.0.0.1", 100))
        assert lanes.get(("P0", "127.0.0.1", 100)) is first
        ran = threading.Event()
        lanes.run(first, ran.set)
        assert ran.wait(5.0)
        for i in range(1, 40):
            lanes.get((f"P{i}", "127.0.0.1", 100 + i))
        assert len(lanes) <= 17  # idle lanes closed (threads joined) once more than 16 exist
    finally:
        lanes.close()
    assert len(lanes) == 0


def test_a_lanes_queue_is_read_in_batches_by_up_to_workers_readers_at_once() -> None:
    """Eight tasks queued at once, batches of 4, 2 readers: both readers run together, 4 tasks each."""
    started = threading.Barrier(2, timeout=5.0)
    batches: list[list[object]] = []

    def run_batch(lane: Lane, batch: list[object]) -> None:
        batches.append(batch)
        started.wait()  # both readers must be inside a batch at the same time (else this times out)

    lanes = Lanes(2, 1.0, run_batch=run_batch, max_batch=4)
    try:
        lane = lanes.get(("P", "127.0.0.1", 1))
        lanes.queue(lane, list(range(8)))
        for _ in range(500):
            if lane.jobs == 0:
                break
            threading.Event().wait(0.01)
        assert lane.jobs == 0 and not started.broken
        assert sorted(len(b) for b in batches) == [4, 4] and sorted(x for b in batches for x in b) == list(range(8))
    finally:
        lanes.close()
