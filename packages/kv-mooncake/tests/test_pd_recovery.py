"""D pulls again from a P that died and came back on its ports, whatever its first request is.

After a P stops answering, its lane on D is open for ``peer_retry_s``; then the next request probes
P and the others fail fast until the probe ends. A probe that ends without a verdict on P (it had
nothing to read, or a live P answered that it holds nothing for it) must still end the probe: the
chaos test in `test_pd_leaks.py` once saw D refuse every request to a restarted P for a minute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess
from ascend_dist.kv_mooncake.core.request import SchedRequest

SPEC = {"layers": 1, "heads": 1, "head_dim": 8, "block_size": 16, "num_blocks": 16}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", ["empty receive", "params the restarted P never lent"])
def test_the_first_request_after_a_restart_cannot_keep_the_lane_half_open(
    make_pair: Callable[..., Any], first: str
) -> None:
    pair = make_pair(p_tp=1, d_tp=1, own_process=True, d_extra={"peer_retry_s": 0.2}, **SPEC)
    d, p = pair.d, pair.p
    assert pair.transfer("ok", 16, seed=1) == set()
    lost, stale = p.prefill("lost", 16, 2), p.prefill("stale", 16, 3)
    p.peer.kill()
    d.decode("lost", 16, lost)
    assert d.wait_recv({"lost"}, timeout_s=10.0)  # P is gone: the lane opens
    d.finish_decode("lost")
    time.sleep(0.3)  # past peer_retry_s: the next request to P probes it
    again = PeerProcess()
    try:
        if first == "empty receive":  # D aborted it before allocating: only a DONE, nothing read
            d.scheduler.request_finished(SchedRequest("stale", 16, dict(stale)), [[]])
            d._step()
            time.sleep(0.3)
            p = again.create(f"{p.name}b", pair.extra, SPEC)
        else:  # P answers "not held": P is alive, the request alone fails
            p = again.create(f"{p.name}b", pair.extra, SPEC)
            d.decode("stale", 16, stale)
            assert d.wait_recv({"stale"}, timeout_s=10.0) == set(d.blocks["stale"][0])
            d.finish_decode("stale")
            time.sleep(0.3)
        # Control: the same request transfers, byte-exact, once the lane lets requests through.
        start = time.monotonic()
        for n in range(3):
            rid = f"fresh{n}"
            d.decode(rid, 16, p.prefill(rid, 16, seed=10 + n))
            assert d.wait_recv({rid}, timeout_s=10.0) == set(), f"D refused {rid} to the restarted P"
            assert d.verify(rid, seed=10 + n) > 0
            d.finish_decode(rid)
        assert time.monotonic() - start < 5.0
    finally:
        if p is not pair.p:
            p.drop()
        again.close()


@pytest.mark.timeout(120)
def test_requests_failed_fast_while_the_lane_is_open_release_the_restarted_ps_blocks_at_once(
    make_pair: Callable[..., Any],
) -> None:
    """P restarted while D's lane to it is still open: D fails the new requests at once (the breaker)
    but must still tell P, which would otherwise hold their blocks for the whole lease."""
    pair = make_pair(p_tp=1, d_tp=1, own_process=True, lease_s=30.0, d_extra={"peer_retry_s": 20.0}, **SPEC)
    d, p = pair.d, pair.p
    assert pair.transfer("ok", 16, seed=1) == set()
    lost = p.prefill("lost", 16, 2)
    p.peer.kill()
    d.decode("lost", 16, lost)
    assert d.wait_recv({"lost"}, timeout_s=10.0)  # the lane opens for 20 s
    d.finish_decode("lost")
    again = PeerProcess()
    try:
        p = again.create(f"{p.name}b", pair.extra, SPEC)
        rids = [f"early{n}" for n in range(3)]
        params = {rid: p.prefill(rid, 16, seed=5) for rid in rids}
        assert p.poll()["blocks_lent"] > 0  # control: P lent them
        for rid in rids:
            d.decode(rid, 16, params[rid])
        start = time.monotonic()
        assert d.wait_recv(set(rids), timeout_s=10.0) == {b for r in rids for b in d.blocks[r][0]}
        assert time.monotonic() - start < 1.0  # failed fast: the breaker holds
        for rid in rids:
            d.finish_decode(rid)
        deadline = time.monotonic() + 5.0  # far inside P's 30 s lease
        while (state := p.poll())["blocks_lent"] or state["tracked"]:
            assert time.monotonic() < deadline, f"P still holds the failed requests' blocks: {state}"
            time.sleep(0.05)
    finally:
        if p is not pair.p:
            p.drop()
        again.close()
