"""Quarantine after a failed or timed-out read, over real processes.

A read that failed or timed out may still write into D's blocks later (Mooncake #4247). D reports
the blocks as load errors at once but keeps the request out of ``finished_recving`` (so vLLM holds
its blocks) until no read is running and ``quarantine_s`` has passed since the last failed read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_engines import EngineWrapper

from ascend_dist.common.errors import TransferError
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, get_engine
from ascend_dist.kv_mooncake.core.tcp_sockets import connections_to


class LateWriter(EngineWrapper):
    """Our `TransferBackend` around the real engine: a read that hangs, then writes late, then fails.

    ``hang`` is cleared by the test to let the hung read go on: the real engine then writes the
    bytes into D's blocks (the late write) and the read reports failure, as Ascend's -1 does.
    """

    def __init__(self, real: MooncakeEngine, *, hang: bool, armed: bool = True) -> None:
        super().__init__(real)
        self.release = threading.Event()
        self.hang = hang
        self.armed = armed  # False: reads pass through untouched (until the test arms it)
        self.entered = threading.Event()
        self.returned = threading.Event()

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        if not self.armed:
            self.real.read(session, batch, timeout_s=timeout_s)
            return
        self.entered.set()
        try:
            if self.hang and not self.release.wait(15.0):
                raise TransferError("test never released the hung read")
            self.real.read(session, batch, timeout_s=timeout_s)  # the late write lands
            raise TransferError("batch_transfer_sync_read returned -1 (simulated outer deadline)")
        finally:
            self.returned.set()


def _poll_until(pair: Any, rid: str, deadline_s: float, *, stop_on_errors: bool = False) -> tuple[bool, set[int]]:
    errors: set[int] = set()
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        _, recv, errs = pair.d.poll()
        errors |= errs
        if rid in recv:
            return True, errors
        if stop_on_errors and errors:
            break
        time.sleep(0.005)
    return False, errors


@pytest.mark.timeout(60)
def test_timed_out_read_is_held_until_it_returns_and_the_quarantine_passes(make_pair: Callable[..., Any]) -> None:
    """A read hangs past the deadline and one more ``pull_timeout_s``: D keeps the request (its
    blocks) as long as the read runs, however long, and cuts its connections to P's transport
    (Mooncake's pooled connections from an earlier pull), so a receive pending there ends, and
    holds the blocks ``cut_hold_s`` past the cut. Before, D handed the blocks back at that point
    with the read still running."""
    engine = LateWriter(get_engine("127.0.0.1", "tcp"), hang=True, armed=False)
    pair = make_pair(
        p_tp=1,
        d_tp=1,
        pull_timeout_s=1.0,
        d_extra={"quarantine_s": 0.4, "peer_retry_s": 0.2, "cut_hold_s": 1.5},
        d_engine=engine,
    )
    assert pair.transfer("warm", 40, seed=4) == set()
    receiver = pair.d.ranks[0].worker.receiver
    meta = receiver.peer_metadata(pair.extra["engine_id"], "127.0.0.1", pair.kv_port)
    assert meta is not None and meta.transport_ports, "P named no transport port"
    assert connections_to("127.0.0.1", meta.transport_ports) > 0  # the warm read's pooled connections
    engine.armed = True
    params = pair.p.prefill("hung", 40, 1)
    pair.d.decode("hung", 40, params)
    assert engine.entered.wait(10.0)
    started = time.monotonic()
    # Past the pull deadline: the blocks are reported failed, but the request is NOT finished
    # while its read can still write.
    finished, errors = _poll_until(pair, "hung", 10.0, stop_on_errors=True)
    assert not finished
    assert errors == set(pair.d.blocks["hung"][0])
    finished, more = _poll_until(pair, "hung", max(0.0, started + 2 * 1.0 + 1.0 - time.monotonic()))
    assert not finished and more == set()  # still held past the deadline plus one more timeout
    assert receiver.quarantined == 1 and receiver.in_flight == 0
    assert connections_to("127.0.0.1", meta.transport_ports) == 0  # cut
    engine.release.set()  # the read goes on, on the connections D cut: it fails
    assert engine.returned.wait(10.0)
    released = time.monotonic()
    finished, errors = _poll_until(pair, "hung", 5.0)
    assert finished and errors == set()  # errors were reported once, earlier
    assert time.monotonic() - released >= 0.4 - 0.05  # held for the quarantine after the failed read
    # and for cut_hold_s after the cut (at the deadline plus one more pull_timeout_s, 2 s in)
    assert time.monotonic() - started >= 2 * 1.0 + 1.5 - 0.1
    assert receiver.quarantined == 0
    pair.d.finish_decode("hung")
    assert pair.wait_p_idle()["blocks_lent"] == 0  # DONE still sent after the failure
    # Mooncake keeps the cut connections pooled and drops each only when a read fails on it: D
    # reads again while a read fails on one of them, so the next pull transfers (it failed before).
    engine.armed = False
    time.sleep(0.3)  # past peer_retry_s: the failed read opened P's breaker
    assert pair.transfer("after", 40, seed=5) == set() and pair.d.verify("after", 5) > 0


@pytest.mark.timeout(60)
def test_failed_read_reports_errors_at_once_and_finishes_after_the_quarantine(
    make_pair: Callable[..., Any],
) -> None:
    engine = LateWriter(get_engine("127.0.0.1", "tcp"), hang=False)
    pair = make_pair(p_tp=1, d_tp=1, groups=2, d_extra={"quarantine_s": 0.6}, d_engine=engine)
    params = pair.p.prefill("bad", 40, 2)
    pair.d.decode("bad", 40, params)
    assert engine.returned.wait(10.0)
    failed_at = time.monotonic()
    finished, errors = _poll_until(pair, "bad", 0.3)
    assert not finished and errors == {b for ids in pair.d.blocks["bad"] for b in ids}  # every group
    finished, _ = _poll_until(pair, "bad", 5.0)
    assert finished and time.monotonic() - failed_at >= 0.6 - 0.05
    pair.d.finish_decode("bad")


@pytest.mark.timeout(60)
def test_zero_quarantine_finishes_with_the_errors(make_pair: Callable[..., Any]) -> None:
    engine = LateWriter(get_engine("127.0.0.1", "tcp"), hang=False)
    pair = make_pair(p_tp=1, d_tp=1, d_extra={"quarantine_s": 0}, d_engine=engine)
    params = pair.p.prefill("now", 40, 3)
    pair.d.decode("now", 40, params)
    errors = pair.d.wait_recv({"now"}, timeout_s=10.0)
    assert errors == set(pair.d.blocks["now"][0])
    pair.d.finish_decode("now")
