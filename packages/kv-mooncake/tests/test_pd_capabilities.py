"""Signed pull capabilities over a real P (child process) and D, side channels on 127.0.0.1 (issue 23).

A client of D who knows one live P request (its own) edits ``remote_block_ids`` to another live
request's blocks (same length): with the deployment secret on both sides D refuses the params
before contacting P (the request fails with load errors and is recomputed) and reads nothing;
P renews and frees only what it signed. The legitimate pulls beside them are served and verified.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from fault_engines import CountingReader

from ascend_dist.common.secret import SECRET_ENV
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.core.capability import Capability, Grant
from ascend_dist.kv_mooncake.core.engine import get_engine
from ascend_dist.kv_mooncake.core.messages import Ack, Done
from ascend_dist.kv_mooncake.pull.messages import DoneItem, Dones, Renew, reply_codec, request_codec

SECRET_HEX = "5e" * 32


def _pull(pair: Any, rid: str, params: dict[str, Any]) -> set[int]:
    """D pulls ``rid`` (40 tokens) with ``params``; its load errors."""
    pair.d.decode(rid, 40, params)
    return pair.d.wait_recv({rid}, timeout_s=15.0)


@pytest.fixture
def signed_pair(make_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """A P child and a D here that share a deployment secret; D's reads are counted."""
    monkeypatch.setenv(SECRET_ENV, SECRET_HEX)  # the P child inherits it; D reads it at construction
    engine = CountingReader(get_engine("127.0.0.1", "tcp"))
    pair = make_pair(p_tp=1, d_tp=1, own_process=True, d_engine=engine)
    return pair, engine


@pytest.mark.timeout(90)
def test_params_widened_to_another_live_requests_blocks_are_refused_by_d_and_never_read(signed_pair: Any) -> None:
    pair, engine = signed_pair
    victim = pair.p.prefill("victim", 40, seed=11)
    mine = pair.p.prefill("mine", 40, seed=22)
    assert len(victim["remote_block_ids"][0]) == len(mine["remote_block_ids"][0]) == 3
    assert victim["remote_block_ids"] != mine["remote_block_ids"]

    forged = {**mine, "remote_block_ids": victim["remote_block_ids"]}  # same length, the victim's blocks
    errors = _pull(pair, "attacker", forged)
    assert errors == set(pair.d.blocks["attacker"][0])  # failed whole: vLLM recomputes it alone
    assert engine.reads == 0  # refused before any read
    with pytest.raises(AssertionError):
        pair.d.verify("attacker", 11)  # the victim's KV is not in the attacker's blocks

    # Control: the same D pulls the untouched params of both, and every byte is the right one.
    assert _pull(pair, "victim", victim) == set()
    assert pair.d.verify("victim", 11) > 0
    assert _pull(pair, "mine", mine) == set()
    assert pair.d.verify("mine", 22) > 0
    assert engine.reads == 2
    assert pair.wait_p_idle()["blocks_lent"] == 0  # the legitimate DONEs freed P's blocks


@pytest.mark.timeout(90)
def test_a_digest_or_request_id_swapped_into_signed_params_is_refused(signed_pair: Any) -> None:
    pair, engine = signed_pair
    victim = pair.p.prefill("victim2", 40, seed=31)
    mine = pair.p.prefill("mine2", 40, seed=32)
    for name, forged in {
        "digest": {**victim, "remote_prompt_digest": "0" * 32},  # the victim's ids for another prompt
        "request": {**mine, "remote_request_id": "victim2", "remote_block_ids": victim["remote_block_ids"]},
        "unsigned": {k: v for k, v in victim.items() if k != "remote_capability"},
        "expiry": {**mine, "remote_capability_expires": mine["remote_capability_expires"] + 3_600_000},
    }.items():
        errors = _pull(pair, f"x-{name}", forged)
        assert errors == set(pair.d.blocks[f"x-{name}"][0]), name
    assert engine.reads == 0
    assert _pull(pair, "victim2", victim) == set()  # control: still held and served
    assert pair.d.verify("victim2", 31) > 0


def _grant(params: dict[str, Any], **changes: Any) -> Grant:
    """The grant D presents for ``params`` (fields of the capability replaced by ``changes``)."""
    cap = Capability(
        params["remote_request_id"],
        params["remote_engine_id"],
        params["remote_block_ids"],
        params.get("remote_prompt_digest") or "",
        params["remote_capability_expires"],
    )
    return Grant(capability=msgspec.structs.replace(cap, **changes), tag=params["remote_capability"])


@pytest.mark.timeout(90)
def test_p_renews_and_frees_only_what_it_signed(signed_pair: Any) -> None:
    pair, _ = signed_pair
    held = pair.p.prefill("held", 40, seed=5)
    other = pair.p.prefill("other", 40, seed=6)
    endpoint = tcp_endpoint("127.0.0.1", pair.kv_port)
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)

    def ask(msg: Any) -> Any:
        return replies.decode(client.request(endpoint, requests.encode(msg)))

    with RpcClient(timeout_s=2.0, retries=1) as client:
        assert ask(Renew(request_ids=["held"])).held == [False]  # no capability
        widened = _grant(held, block_ids=other["remote_block_ids"])  # the other request's blocks, held's tag
        assert ask(Renew(request_ids=["held"], grants=[widened])).held == [False]
        assert ask(Renew(request_ids=["other"], grants=[_grant(held)])).held == [False]  # another id's grant
        assert ask(Renew(request_ids=["held"], grants=[_grant(held)])).held == [True]  # control: signed
        # One batch: each id is checked against its own grant, the signed one alone is held.
        batch = Renew(request_ids=["held", "other", "held"], grants=[_grant(held), _grant(held), widened])
        assert ask(batch).held == [True, False, False]
        assert ask(Renew(request_ids=["held", "other"], grants=[_grant(held)])).held == [False, False]

        lent = pair.p.poll()["blocks_lent"]
        assert lent == 6
        assert ask(Done(request_id="held", d_rank=0, ok=True)) == Ack()  # unsigned: same answer, not counted
        assert ask(Done(request_id="held", d_rank=0, ok=True, grant=widened)) == Ack()
        forged = [DoneItem(request_id="held", ok=True), DoneItem(request_id="held", ok=True, grant=widened)]
        assert ask(Dones(d_rank=0, items=forged)) == Ack()  # a batch of unsigned ones: none counted
        assert pair.p.poll()["blocks_lent"] == lent  # nothing freed
        signed = [DoneItem(request_id="held", ok=True, grant=_grant(held)), DoneItem(request_id="x", ok=True)]
        assert ask(Dones(d_rank=0, items=signed)) == Ack()  # control: the signed item counts
        assert ask(Done(request_id="other", d_rank=0, ok=True, grant=_grant(other))) == Ack()
    assert pair.wait_p_idle()["blocks_lent"] == 0
