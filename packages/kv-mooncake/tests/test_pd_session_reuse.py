"""A P restarted on a dead P's ports, over real Mooncake TCP (P in child processes, D here).

On its side-channel port: D's cached side-channel metadata names the dead process; P's `Held`
names the process answering, so D never reads with the dead one's (`PeerRestarted`).

On its Mooncake RPC port: Mooncake keeps a peer's descriptor per session name (``host:rpc_port``)
for the life of the reading process and over TCP never refreshes it (`core.session_owners`). A new
P on the dead one's session and another transport port must be refused at once, without a read
(before, each of its requests read, failed after a second of reconnecting to the dead port, and
was reported as P not answering); one that took the dead one's transport port too is read (right
bytes).

Mooncake draws both ports from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT`` at random (its RPC
listener with ``SO_REUSEADDR`` per its source, so a port in TIME_WAIT will do; its transport
without). Each restart here is tried until it drew the ports the case needs (as its engine names
them), and a try that drew others is stopped before anything reached it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_engines import CountingReader

from ascend_dist.common.errors import ProtocolError
from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess, PInstance, fresh_rpc_ports, wait_ports_released
from ascend_dist.kv_mooncake.core.engine import get_engine

SPEC = {"layers": 4, "heads": 4, "head_dim": 16, "block_size": 16, "num_blocks": 32}
TRIES = 30


def _lent(p: Any, polls: int = 300) -> int:
    """P's lent blocks once none are left (or after ``polls`` polls 10 ms apart)."""
    lent = -1
    for _ in range(polls):
        lent = int(p.poll()["blocks_lent"])
        if lent == 0:
            break
        time.sleep(0.01)
    return lent


def _mooncake_ports(p: PInstance) -> tuple[int, int]:
    """``(RPC port, transport port)`` of the P instance's Mooncake engine."""
    rpc, (transport,) = p.mooncake_ports()
    return rpc, transport


def _start_drawing(
    pair: Any, window: range, wanted: Callable[[int, int], bool], name: str
) -> tuple[PeerProcess, PInstance]:
    """A P child on ``pair``'s side-channel ports whose Mooncake ports satisfy ``wanted(rpc, transport)``."""
    drawn: list[tuple[int, int] | str] = []
    for _ in range(TRIES):
        peer = PeerProcess(rpc_ports=(window[0], window[-1]))
        try:
            p = peer.create(name, pair.extra, SPEC)
            drawn.append(_mooncake_ports(p))
            if wanted(*drawn[-1]):
                return peer, p
        except ProtocolError:  # Mooncake found no free transport port left in the window this time
            drawn.append("no engine")
        peer.close()  # nothing reached it: its ports are free again at once
    raise AssertionError(f"no P drew the wanted Mooncake ports from {window} in {TRIES} starts: {drawn}")


def _kill_and_forget(pair: Any, peer: PeerProcess, params: dict[str, Any], rid: str) -> None:
    """Kill ``peer`` and pull ``rid`` from it: the failure makes D drop that P's side-channel metadata."""
    peer.kill()
    pair.d.decode(rid, 40, params)
    assert pair.d.wait_recv({rid}, timeout_s=15.0) == set(pair.d.blocks[rid][0])


def _session_port(pair: Any) -> int:
    """The Mooncake RPC port of the P whose metadata ``pair``'s D last fetched."""
    meta = pair.d.ranks[0].worker.receiver.peer_metadata(pair.extra["engine_id"], "127.0.0.1", pair.kv_port)
    assert meta is not None
    return int(meta.te_session.rsplit(":", 1)[1])


@pytest.mark.timeout(400)
def test_a_p_restarted_on_a_dead_ps_mooncake_session_is_refused_at_once_or_read_right(
    make_pair: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="ascend_dist.kv_mooncake.pull.threads")
    # Four ports of its own: the dead P draws the middle two, so a spare lies beside either of them.
    first, _ = fresh_rpc_ports()
    engine = CountingReader(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(own_process=True, rpc_ports=(first + 1, first + 2), d_engine=engine, d_extra={"peer_retry_s": 0.2})
    assert pair.transfer("first", 40, seed=1) == set()
    assert pair.d.verify("first", 1) > 0 and engine.reads == 1  # D's Mooncake now caches this P's descriptor
    rpc, transport = _mooncake_ports(pair.p)
    assert _session_port(pair) == rpc  # control of the helper: what D read is that session
    _kill_and_forget(pair, pair.p.peer, pair.p.prefill("dead", 40, 2), "dead")

    # The dead session on the spare port: D refuses at once and reads nothing. The window holds only
    # the dead session's port and the spare beside it, so about every other start draws the case
    # (with the dead transport port in it too, one start in six did: 30 starts once drew none).
    reads = engine.reads
    moved = range(first, first + 2) if rpc == first + 1 else range(first + 2, first + 4)
    peer, p = _start_drawing(pair, moved, lambda r, t: r == rpc and t != transport, "moved")
    with peer:
        params = p.prefill("moved", 40, 3)
        caplog.clear()
        start = time.monotonic()
        pair.d.decode("moved", 40, params)
        errors = pair.d.wait_recv({"moved"}, timeout_s=15.0)
        took = time.monotonic() - start
        assert errors == set(pair.d.blocks["moved"][0])  # failed whole: vLLM recomputes it
        assert f"Mooncake session 127.0.0.1:{rpc} now belongs to" in caplog.text  # this reason, no other
        assert engine.reads == reads, "read through the dead P's descriptor"
        assert took < 0.5, f"refusing took {took:.3f} s"
        assert _lent(p) == 0  # D's DONE gave P its blocks back at once, not after the lease
        peer.kill()  # nothing was read: no TIME_WAIT left behind

    # The dead session on the dead one's transport port too: read, byte-exact.
    wait_ports_released(range(first, first + 4), timeout_s=90.0)
    peer, p = _start_drawing(pair, range(first + 1, first + 3), lambda r, t: r == rpc and t == transport, "same")
    with peer:
        params = p.prefill("same", 40, 4)
        pair.d.decode("same", 40, params)
        assert pair.d.wait_recv({"same"}, timeout_s=15.0) == set()
        assert pair.d.verify("same", 4) > 0 and engine.reads > reads  # (a pooled dead connection: read again)
        assert _session_port(pair) == rpc
        p.drop()

    # Control: a P on a session of its own is read through the same Mooncake engine.
    other = make_pair(own_process=True, d_engine=engine)
    assert other.transfer("fresh", 40, seed=5) == set() and other.d.verify("fresh", 5) > 0


@pytest.mark.timeout(120)
def test_a_p_restarted_on_its_side_channel_port_is_never_read_with_the_dead_ones_metadata(
    make_pair: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """P killed with nothing pulled from it since, so D still caches its side-channel metadata; a new
    P on the same side-channel port (a Mooncake session of its own) answers D's `Renew` as another
    process: its request fails at once without a read (before, D read the dead process's session and
    addresses: a hung read, then a failure), and the next request fetches the new P's metadata and
    reads byte-exact."""
    caplog.set_level(logging.ERROR, logger="ascend_dist.kv_mooncake.pull.threads")
    engine = CountingReader(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(own_process=True, d_engine=engine)
    assert pair.transfer("first", 40, seed=1) == set() and pair.d.verify("first", 1) > 0
    dead_session = _session_port(pair)
    pair.p.peer.kill()  # D is not told: its cached metadata names the dead process
    with PeerProcess() as peer:  # a Mooncake window no earlier child had: another session
        p = peer.create("restarted", pair.extra, SPEC)
        reads = engine.reads
        start = time.monotonic()
        pair.d.decode("stale", 40, p.prefill("stale", 40, 2))
        errors = pair.d.wait_recv({"stale"}, timeout_s=15.0)
        took = time.monotonic() - start
        assert errors == set(pair.d.blocks["stale"][0])  # failed whole: vLLM recomputes it
        assert engine.reads == reads, "read with the dead P's metadata"
        assert "restarted since D fetched its metadata" in caplog.text
        assert took < 1.0, f"refusing took {took:.3f} s"
        assert _lent(p) == 0  # D's DONE gave the new P its blocks back at once
        # The next request is read from the new P, through its own session.
        pair.d.decode("fresh", 40, p.prefill("fresh", 40, 3))
        assert pair.d.wait_recv({"fresh"}, timeout_s=15.0) == set()
        assert pair.d.verify("fresh", 3) > 0 and engine.reads > reads
        assert _session_port(pair) != dead_session
        p.drop()
