"""A P restarted on a dead P's Mooncake RPC port, over real Mooncake TCP (P in child processes, D here).

Mooncake keeps a peer's descriptor per session name (``host:rpc_port``) for the life of the reading
process and over TCP never refreshes it (`core.session_owners`). A new P that took the dead one's
transport port too is read (right bytes); one on another transport port must be refused at once,
without a read (before, each of its requests read, failed after a second of reconnecting to the
dead port, and was reported as P not answering). Both children draw their Mooncake ports from the
same two (``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``); the restart waits out the 60 s of TIME_WAIT
the dead one's ports stay in, which is also why such a reuse happens only a minute or more later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_engines import CountingReader

from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess, fresh_rpc_ports, ports_in_use
from ascend_dist.kv_mooncake.core.engine import get_engine

SPEC = {"layers": 4, "heads": 4, "head_dim": 16, "block_size": 16, "num_blocks": 32}


def _lent(p: Any, polls: int = 300) -> int:
    """P's lent blocks once none are left (or after ``polls`` polls 10 ms apart)."""
    lent = -1
    for _ in range(polls):
        lent = int(p.poll()["blocks_lent"])
        if lent == 0:
            break
        time.sleep(0.01)
    return lent


def _wait_released(ports: tuple[int, int], timeout_s: float = 90.0) -> None:
    """Wait until no socket uses ``ports``: a dead P's ports stay in TIME_WAIT for 60 s after the
    handshakes it closed first, and Mooncake binds without ``SO_REUSEADDR``."""
    deadline = time.monotonic() + timeout_s
    while ports_in_use(ports):
        if time.monotonic() > deadline:
            raise AssertionError(f"ports {ports} still in use after {timeout_s} s")
        time.sleep(1.0)


def _kill_and_forget(pair: Any, peer: PeerProcess, params: dict[str, Any], rid: str) -> None:
    """Kill ``peer`` and pull ``rid`` from it: the failure makes D drop that P's side-channel metadata."""
    peer.kill()
    pair.d.decode(rid, 40, params)
    assert pair.d.wait_recv({rid}, timeout_s=15.0) == set(pair.d.blocks[rid][0])


def _agent(pair: Any) -> Any:
    """The metadata of the P that ``pair``'s D last fetched it from."""
    meta = pair.d.ranks[0].worker.receiver.peer_metadata(pair.extra["engine_id"], "127.0.0.1", pair.kv_port)
    assert meta is not None
    return meta


@pytest.mark.timeout(400)
def test_a_p_restarted_on_a_dead_ps_mooncake_session_is_read_right_or_refused_at_once(
    make_pair: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="ascend_dist.kv_mooncake.pull.threads")
    first, _ = fresh_rpc_ports()
    window = (first, first + 1)  # Mooncake draws its RPC and its transport port from these two
    engine = CountingReader(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(own_process=True, rpc_ports=window, d_engine=engine, d_extra={"peer_retry_s": 0.2})
    assert pair.transfer("first", 40, seed=1) == set()
    assert pair.d.verify("first", 1) > 0 and engine.reads == 1  # D's Mooncake now caches this P's descriptor
    dead = _agent(pair)

    _kill_and_forget(pair, pair.p.peer, pair.p.prefill("dead", 40, 2), "dead")

    # A new P on the same side-channel ports draws its two Mooncake ports from the same two, once
    # TIME_WAIT let them go; one that takes them the other way round has a session of its own: a control.
    for attempt in range(3):
        _wait_released(window)  # also past peer_retry_s: the lane lets the next request ask P
        reads, rid, seed = engine.reads, f"again{attempt}", 10 + attempt
        with PeerProcess(rpc_ports=window) as again:
            p = again.create(rid, pair.extra, SPEC)
            params = p.prefill(rid, 40, seed)
            caplog.clear()
            start = time.monotonic()
            pair.d.decode(rid, 40, params)
            errors = pair.d.wait_recv({rid}, timeout_s=15.0)
            took = time.monotonic() - start
            if errors:  # refused: the session is the dead one's, its transport port another
                assert f"Mooncake session {dead.te_session} now belongs to" in caplog.text  # this reason
                assert errors == set(pair.d.blocks[rid][0])  # failed whole: vLLM recomputes it
                assert engine.reads == reads, "read through the dead P's descriptor"
                assert took < 0.5, f"refusing took {took:.3f} s"
                assert _lent(p) == 0  # D's DONE gave P its blocks back at once, not after the lease
            else:  # read: the right bytes, through the old descriptor only if it names P's transport port
                assert pair.d.verify(rid, seed) > 0 and engine.reads > reads  # (a pooled dead connection: read again)
                agent = _agent(pair)
                assert agent.owner != dead.owner
                assert agent.te_session != dead.te_session or agent.transport_ports == dead.transport_ports
                reused = agent.te_session == dead.te_session
                if not reused:  # a control: D must drop its metadata before the next P on these ports
                    _kill_and_forget(pair, again, p.prefill(f"gone{attempt}", 40, seed), f"gone{attempt}")
                    continue
            p.drop()
            break
    else:
        raise AssertionError(f"no P took session {dead.te_session} again in 3 starts")

    # Control: a P on a session of its own is read through the same Mooncake engine.
    other = make_pair(own_process=True, d_engine=engine)
    assert other.transfer("fresh", 40, seed=4) == set() and other.d.verify("fresh", 4) > 0
