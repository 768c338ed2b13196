"""A layer-wise D restarted on its side-channel ports, with P still caching the dead D's metadata.

P fetches each D worker's metadata (engine id, Mooncake session, KV addresses) once per endpoint
and writes with it. A D restarted on the same ports is a new worker with new KV tensors: P must
neither refuse it for good (a new engine id, as vLLM draws one at each start) nor write into it
with the dead worker's addresses (an engine id pinned in the configuration). P runs in its own
process (the shared child), D in this one: the restarted D shares this process's Mooncake engine,
so the dead D's session still answers, and the dead D's tensors are kept alive, so a write with
their addresses lands there harmlessly and shows as the new D's blocks left unwritten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from ascend_dist.common.regions import RegisterRegions
from ascend_dist.kv_mooncake._demo.peer_process import start_on_same_port
from ascend_dist.kv_mooncake._demo.push_synthetic import LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model

PROMPT = 64  # 4 blocks of 16 tokens


def _restart_d(pair: Any, engine_id: str) -> LwInstance:
    """Stop D's workers and start new ones on the same ports; returns the dead D (keep it referenced)."""
    dead: LwInstance = pair.d
    dead.shutdown()
    config = dataclasses.replace(dead.config, engine_id=engine_id)
    pair.d = start_on_same_port(lambda: LwInstance(config, Model(**pair.spec), metaserver=pair.metaserver))
    return dead


def _register_again(dead: LwInstance) -> RegisterRegions:
    """Register the dead D's KV memory in this process's Mooncake engine again (whole storages)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for rank in dead.ranks
        for parts in rank.caches.values()
        for t in parts
    }
    regions = RegisterRegions(tuple(storages), tuple(storages.values()))
    assert dead.engine is not None
    dead.engine.register(regions)
    return regions


def _all_blocks(pair: Any, rid: str) -> set[int]:
    return {b for group in pair.d.blocks[rid] for b in group}


def _transfer_and_check(pair: Any, rid: str, seed: int) -> bool:
    """Push ``rid``; True when it arrived byte-exact, False when it failed whole (every block a load error).

    Anything else (some blocks reported, or reported received with bytes other than P's) fails the test.
    """
    errors = pair.transfer(rid, PROMPT, seed)
    try:
        if errors:
            assert errors == _all_blocks(pair, rid), f"{rid}: only some blocks reported: {sorted(errors)}"
            return False
        assert pair.d.verify(rid, seed) > 0  # raises naming the layer whose bytes are not P's
        return True
    finally:
        pair.d.finish(rid)


@pytest.mark.timeout(90)
def test_a_d_restarted_with_a_new_engine_id_is_pushed_to_again(make_lw_pair: Callable[..., Any]) -> None:
    """vLLM draws a new engine id at each start. Before the fix P compared the params' engine id
    with the dead D's cached metadata and failed every request to the restarted D, for good."""
    pair = make_lw_pair()
    assert _transfer_and_check(pair, "before", seed=1)
    dead = _restart_d(pair, engine_id=f"{pair.d.config.engine_id}-restarted")  # noqa: F841 (kept alive)
    arrived = [_transfer_and_check(pair, f"after{i}", seed=10 + i) for i in range(3)]
    reasons = pair.d.ranks[0].worker.failure_reasons
    assert arrived == [True, True, True], reasons  # P fetches the new D's metadata at once


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dead_memory", ["unregistered", "registered"])
def test_a_d_restarted_with_its_engine_id_pinned_is_never_written_with_the_dead_ones_addresses(
    make_lw_pair: Callable[..., Any], dead_memory: str
) -> None:
    """An engine id pinned in ``kv_transfer_config`` is the same after the restart, so P's cached
    metadata looks right. ``unregistered``: Mooncake refuses a write outside D's registered memory,
    so before the fix the first request failed on it. ``registered``: the dead worker's addresses lie
    in memory D's Mooncake engine has registered, as when a new D process's KV cache is allocated
    over them (device allocators hand out the same addresses again; a changed ``num_blocks`` moves
    the blocks): before the fix P wrote every request there and D reported it received, its own
    blocks holding none of P's bytes. Now D's answer to P's claim names the worker answering; P
    fails that step's requests to it (load errors: vLLM recomputes), drops the metadata and writes
    the next ones into the new worker's blocks."""
    pair = make_lw_pair()
    assert _transfer_and_check(pair, "before", seed=1)
    dead = _restart_d(pair, engine_id=pair.d.config.engine_id)
    regions = _register_again(dead) if dead_memory == "registered" else None
    try:
        first = _transfer_and_check(pair, "after0", seed=10)
        later = [_transfer_and_check(pair, f"after{i}", seed=10 + i) for i in range(1, 3)]
    finally:
        if regions is not None:
            assert dead.engine is not None
            dead.engine.unregister(regions)
    reasons = pair.d.ranks[0].worker.failure_reasons
    assert not first and "restarted since P fetched its metadata" in reasons["after0"], reasons
    assert later == [True, True], reasons
