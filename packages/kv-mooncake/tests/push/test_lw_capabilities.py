"""Signed push capabilities: D signs the blocks it announces; P pushes only into those (schedulers, then a real P)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ascend_dist.common.secret import SECRET_ENV, DeploymentSecret
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver, LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.scheduler import LayerwiseScheduler, Scheduled

SECRET = DeploymentSecret(b"k" * 32)
URL = "http://127.0.0.1/v1/metaserver"


def _cfg(role: str, engine_id: str) -> LayerwiseConfig:
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}
    return LayerwiseConfig.from_kv_transfer_config(engine_id=engine_id, kv_role=role, kv_port=40000, extra=extra)


def _announce(d: LayerwiseScheduler, ms: CollectingMetaserver, rid: str, ids: list[int]) -> dict[str, Any]:
    req = SchedRequest(rid, 40, {"do_remote_prefill": True, "metaserver": URL}, prompt_digest="ab" * 16)
    d.get_num_new_matched_tokens(req, 0)
    d.update_state_after_alloc(req, [ids], 40)
    return ms.take(rid)


def _pushed(p: LayerwiseScheduler, params: dict[str, Any], rid: str = "p-req") -> list[list[int]] | None:
    """D's block ids P's step would write for ``params`` (None: nothing planned)."""
    p.update_state_after_alloc(SchedRequest(rid, 40, {**params, "do_remote_decode": True}), [[20, 21, 22]], 0)
    send = p.build_connector_meta({rid: Scheduled(0, 40)}).send
    return send[0].params.remote_block_ids if send else None


@pytest.fixture
def d_and_p() -> Any:
    ms = CollectingMetaserver()
    d = LayerwiseScheduler(_cfg("kv_consumer", "D0"), [16], metaserver=ms, secret=SECRET)
    p = LayerwiseScheduler(_cfg("kv_producer", "P0"), [16], secret=SECRET)
    yield d, ms, p
    d.close()


def test_p_pushes_the_signed_announcement_into_exactly_its_blocks(d_and_p: Any) -> None:
    d, ms, p = d_and_p
    posted = _announce(d, ms, "mine", [4, 5, 6])
    assert len(posted["remote_capability"]) == 64 and posted["remote_capability_expires"] > 0
    assert _pushed(p, posted) == [[4, 5, 6]]  # control for the refusals below


@pytest.mark.parametrize(
    "change",
    [
        {"remote_block_ids": "victim"},  # another live request's blocks, same length
        {"remote_block_ids": [[4, 5, 6, 7]]},  # widened
        {"request_id": "victim"},
        {"remote_engine_id": "D9"},
        {"remote_prompt_digest": "cd" * 16},
        {"remote_capability_expires": 2**40},
        {"remote_capability": None},
    ],
    ids=["other-blocks", "widened", "request", "engine", "prompt", "expiry", "unsigned"],
)
def test_p_writes_nothing_for_params_d_did_not_sign(d_and_p: Any, change: dict[str, Any]) -> None:
    d, ms, p = d_and_p
    victim = _announce(d, ms, "victim", [1, 2, 3])
    mine = _announce(d, ms, "mine", [4, 5, 6])
    if change.get("remote_block_ids") == "victim":
        change = {"remote_block_ids": victim["remote_block_ids"]}
    forged = {k: v for k, v in {**mine, **change}.items() if v is not None}
    assert _pushed(p, forged) is None
    assert p.tracked == 0


def test_an_expired_announcement_is_not_pushed() -> None:
    ms = CollectingMetaserver()
    d = LayerwiseScheduler(_cfg("kv_consumer", "D0"), [16], metaserver=ms, secret=SECRET, wall_clock=lambda: 1000.0)
    try:
        posted = _announce(d, ms, "old", [1, 2])
    finally:
        d.close()
    late = LayerwiseScheduler(_cfg("kv_producer", "P0"), [16], secret=SECRET, wall_clock=lambda: 1000.0 + 10_000)
    assert _pushed(late, posted) is None
    on_time = LayerwiseScheduler(_cfg("kv_producer", "P0"), [16], secret=SECRET, wall_clock=lambda: 1001.0)
    assert _pushed(on_time, posted) == [[1, 2]]


def test_without_a_secret_nothing_is_signed_or_checked() -> None:
    ms = CollectingMetaserver()
    d = LayerwiseScheduler(_cfg("kv_consumer", "D0"), [16], metaserver=ms)
    try:
        posted = _announce(d, ms, "r", [1, 2])
    finally:
        d.close()
    assert "remote_capability" not in posted or posted["remote_capability"] is None
    assert _pushed(LayerwiseScheduler(_cfg("kv_producer", "P0"), [16]), posted) == [[1, 2]]


@pytest.mark.timeout(120)
def test_a_real_p_writes_nothing_into_another_requests_blocks(
    make_lw_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real P child and D (127.0.0.1), the secret on both: params redirected to the victim's blocks push nothing."""
    monkeypatch.setenv(SECRET_ENV, "3c" * 32)  # the P child inherits it; D reads it at construction
    pair = make_lw_pair(p_procs=True, d_extra={"first_layer_timeout_s": 2.0})
    pair.d.announce("victim", 40)
    victim = pair.metaserver.take("victim")
    pair.d.announce("mine", 40)
    mine = pair.metaserver.take("mine")
    assert victim["remote_block_ids"] != mine["remote_block_ids"]
    assert len(victim["remote_block_ids"][0]) == len(mine["remote_block_ids"][0])

    pair.send_prefill(victim, 40, seed=11)  # control: the signed announcement is pushed byte-exact
    pair.read_prefill()
    assert pair.d.wait_recv({"victim"}, timeout_s=20.0) == set()
    assert pair.d.verify("victim", 11) > 0

    forged = {**mine, "remote_block_ids": victim["remote_block_ids"]}  # a client's edit, same length
    pair.send_prefill(forged, 40, seed=99)
    pair.read_prefill()
    mine_blocks = {b for ids in pair.d.blocks["mine"] for b in ids}
    assert pair.d.wait_recv({"mine"}, timeout_s=20.0) == mine_blocks  # nothing came: D recomputes it
    assert pair.d.verify("victim", 11) > 0  # the victim's KV was not overwritten


@pytest.mark.timeout(120)
def test_a_real_p_writes_nothing_into_another_d_behind_a_redirected_port(
    make_lw_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Signed params aimed at another D (host and port are not signed) whose live request has the same id."""
    monkeypatch.setenv(SECRET_ENV, "3c" * 32)
    pair = make_lw_pair(p_procs=True, d_extra={"first_layer_timeout_s": 2.0})
    base = {k: v for k, v in pair.extra.items() if k not in ("engine_id", "kv_port")}
    other_port = free_port_range(1)
    other = LwInstance(
        LayerwiseConfig.from_kv_transfer_config(
            engine_id="LD-other",
            kv_role="kv_consumer",
            kv_port=other_port,
            extra={**base, "first_layer_timeout_s": 2.0},
            model="synthetic",
            dtype="int16",
        ),
        Model(**pair.spec),
        metaserver=CollectingMetaserver(),
    )
    try:
        pair.d.announce("pad", 40)  # D's own "mine" then gets other block ids than the other D's
        pair.metaserver.take("pad")
        pair.d.announce("mine", 40)
        mine = pair.metaserver.take("mine")
        other.announce("mine", 40)  # the other D's live request with the same id
        assert other.blocks["mine"] != pair.d.blocks["mine"]

        redirected = {**mine, "remote_port": other.config.d_ports.dp_base(0)}
        pair.send_prefill(redirected, 40, seed=77)
        pair.read_prefill()
        errors = other.wait_recv({"mine"}, timeout_s=20.0)
        # Never reported loaded: the other D's blocks of "mine" hold nothing P computed for it.
        assert errors == {b for ids in other.blocks["mine"] for b in ids}
    finally:
        other.shutdown()
