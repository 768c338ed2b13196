"""An SFA P restarted on a dead P's Mooncake RPC port, over real Mooncake TCP (P in child processes, D here).

D reads P's memory through its Mooncake engine, which keeps a P's segment descriptor (its transport
port) per session name ``host:rpc_port`` for the life of D's process and over TCP never refreshes
it (`core.session_owners`). A new P on the dead one's session but another transport port would be
read through the dead one's descriptor. D must refuse its reads at once (P's `Hello` names its
process and transport ports), fail those requests (vLLM recomputes them), and go on reading every
other P through the same engine.

Mooncake draws both ports from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``; each P child is started
again until it drew the ports the case needs, and a start that drew others is stopped before
anything reached it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
from fault_engines import CountingReader

from ascend_dist.common.errors import ProtocolError
from ascend_dist.kv_mooncake._demo.peer_process import fresh_rpc_ports, wait_ports_released
from ascend_dist.kv_mooncake._demo.sfa_peer_process import SfaP, SfaPeer
from ascend_dist.kv_mooncake._demo.sfa_synthetic import SfaDInstance
from ascend_dist.kv_mooncake.core.engine import Reader

PROMPT = 24
TRIES = 30


def _start(pair: Any, window: tuple[int, int], name: str) -> tuple[SfaPeer, SfaP]:
    """A P child like ``pair``'s (config and model), its Mooncake ports drawn from ``window``."""
    peer = SfaPeer(rpc_ports=window)
    try:
        return peer, peer.create_p(name, {**pair.extra, "engine_id": name}, dataclasses.asdict(pair.d.model))
    except BaseException:
        peer.close()
        raise


def _ports(p: SfaP) -> tuple[int, int]:
    rpc, (transport,) = p.mooncake_ports()
    return rpc, transport


def _start_drawing(pair: Any, window: range, wanted: Callable[[int, int], bool], name: str) -> tuple[SfaPeer, SfaP]:
    """A P child whose Mooncake ports, drawn from ``window``, satisfy ``wanted(rpc, transport)``."""
    drawn: list[tuple[int, int] | str] = []
    for _ in range(TRIES):
        try:
            peer, p = _start(pair, (window[0], window[-1]), name)
        except ProtocolError:  # Mooncake found no free transport port in the window this time
            drawn.append("no engine")
            continue
        drawn.append(_ports(p))
        if wanted(*drawn[-1]):
            return peer, p
        peer.close()  # nothing reached it: its ports are free again at once
    raise AssertionError(f"no P drew the wanted Mooncake ports from {window} in {TRIES} starts: {drawn}")


def _run(d: SfaDInstance, p: SfaP, rid: str, seed: int) -> tuple[set[int], float]:
    """D allocates ``rid``, P prefills it; D's load errors and the seconds to them."""
    params = d.decode(rid, PROMPT)
    start = time.monotonic()
    p.prefill([{"rid": f"p-{rid}", "prompt_len": PROMPT, "seed": seed, "params": params, "chunk": 0}])
    errors = d.wait_recv({rid}, timeout_s=15.0)
    return errors, time.monotonic() - start


@pytest.mark.timeout(300)
def test_a_p_restarted_on_a_dead_ps_mooncake_session_is_refused_at_once_and_others_are_read(
    make_sfa_pair: Callable[..., Any],
) -> None:
    readers: list[CountingReader] = []

    def counted(engine: Reader) -> Reader:
        readers.append(CountingReader(engine))
        return readers[-1]  # type: ignore[return-value]  # forwards every Reader call

    # Four ports of its own: the dead P draws the middle two, so a spare lies beside either of them.
    first, _ = fresh_rpc_ports()
    pair = make_sfa_pair(p_rpc_ports=(first + 1, first + 2), d_reader=counted)
    d, engine = pair.d, readers[0]
    assert _run(d, pair.p, "first", seed=1)[0] == set()
    assert d.verify("first", 1) > 0 and engine.reads > 0  # D's engine now keeps this P's descriptor
    rpc, transport = _ports(pair.p)
    pair.p.kill()

    # The dead session on the spare port: D refuses the reads at once and reads nothing. D's engine
    # keeps its connections to the dead P (CLOSE_WAIT), so the dead P's ends hold its ports until
    # the kernel drops them (tcp_fin_timeout, 60 s): until then no P can take its RPC port.
    wait_ports_released([rpc])
    reads = engine.reads
    moved = range(first, first + 2) if rpc == first + 1 else range(first + 2, first + 4)
    peer, p = _start_drawing(pair, moved, lambda r, t: r == rpc and t != transport, "SP-moved")
    with peer:
        errors, took = _run(d, p, "moved", seed=2)
        assert errors and errors <= set(d.alloc.held["moved"][0])  # failed: vLLM recomputes it
        assert engine.reads == reads, "read through the dead P's descriptor"
        reasons = p.drain()["failed"]
        assert any(f"Mooncake session 127.0.0.1:{rpc} now belongs to" in r for r in reasons.values()), reasons
        assert took < 5.0, f"refusing took {took:.3f} s"
        assert _run(d, p, "again", seed=3)[0]  # and stays refused: D's engine keeps the dead descriptor
        assert engine.reads == reads
        peer.kill()

    # Control: a P on a session of its own is read through the same engine, byte-exact.
    peer, fresh = _start(pair, fresh_rpc_ports(), "SP-fresh")
    with peer:
        assert _run(d, fresh, "fresh", seed=4)[0] == set()
        assert d.verify("fresh", 4) > 0 and engine.reads > reads
