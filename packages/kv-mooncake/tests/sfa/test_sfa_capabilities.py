"""Signed SFA contacts at the schedulers: D signs the contact it posts; P offers reads only for signed ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from ascend_dist.common.secret import SECRET_ENV, DeploymentSecret
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.sfa_synthetic import SfaDInstance, SfaModel
from ascend_dist.kv_mooncake.core.engine import get_engine
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.messages import ContactInfo
from ascend_dist.kv_mooncake.sfa.plan import GroupIds
from ascend_dist.kv_mooncake.sfa.scheduler import ConsumerScheduler, ProducerScheduler, SfaRequest, StepRequest

SECRET = DeploymentSecret(b"s" * 32)
_BASE: dict[str, Any] = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "transfer_backend": "mooncake"}


def _cfg(role: str, engine_id: str) -> SfaConfig:
    return SfaConfig.from_kv_transfer_config(engine_id=engine_id, kv_role=role, kv_port=40000, extra=dict(_BASE))


class _Sink:
    def __init__(self) -> None:
        self.posted: dict[str, ContactInfo] = {}

    def post(self, ext_id: str, contact: ContactInfo, url: str | None = None) -> None:
        self.posted[ext_id] = contact

    def cancel(self, ext_id: str) -> None:
        pass


def _posted(d: ConsumerScheduler, sink: _Sink, ext_id: str) -> dict[str, Any]:
    req = SfaRequest(f"{ext_id}-1", ext_id, 32, {"do_remote_prefill": True, "metaserver": "http://127.0.0.1/m"})
    assert d.get_num_new_matched_tokens(req, 0) == (32, True)
    d.update_state_after_alloc(req, [[1, 2], [3, 4]], 32, 0)
    return msgspec.to_builtins(sink.posted[ext_id])  # as JSON through the proxy


def _offered(p: ProducerScheduler, contact: dict[str, Any], rid: str = "p-1") -> list[str]:
    """D ext ids P's step would offer reads to for a request carrying ``contact``."""
    p.update_state_after_alloc(SfaRequest(rid, str(contact["request_id"]), 32, {**contact, "do_remote_decode": True}))
    return [s.ext_id for s in p.build_connector_meta([StepRequest(rid, 0, 32, ((5, 6), (7, 8)), is_new=True)]).requests]


@pytest.fixture
def d_and_p() -> Any:
    sink = _Sink()
    d = ConsumerScheduler(_cfg("kv_consumer", "D0"), [16, 16], GroupIds(0, 1), sink, secret=SECRET)
    p = ProducerScheduler(_cfg("kv_producer", "P0"), [16, 16], GroupIds(0, 1), secret=SECRET)
    return d, sink, p


def test_p_offers_reads_for_the_contact_d_signed(d_and_p: Any) -> None:
    d, sink, p = d_and_p
    mine = _posted(d, sink, "mine")
    assert len(mine["remote_capability"]) == 64
    assert _offered(p, mine) == ["mine"]  # control for the refusals below


@pytest.mark.parametrize(
    "change",
    [
        {"request_id": "victim"},  # P's reads aimed at another client's D request
        {"remote_engine_id": "D9"},
        {"remote_capability_expires": 2**40},
        {"remote_capability": None},
    ],
    ids=["other-request", "engine", "expiry", "unsigned"],
)
def test_p_offers_nothing_for_a_contact_d_did_not_sign(d_and_p: Any, change: dict[str, Any]) -> None:
    d, sink, p = d_and_p
    _posted(d, sink, "victim")
    mine = _posted(d, sink, "mine")
    forged = {k: v for k, v in {**mine, **change}.items() if v is not None}
    assert _offered(p, forged) == []
    assert p.tracked == 0


def test_without_a_secret_contacts_are_unsigned_and_unchecked() -> None:
    sink = _Sink()
    d = ConsumerScheduler(_cfg("kv_consumer", "D0"), [16, 16], GroupIds(0, 1), sink)
    contact = _posted(d, sink, "r")
    assert contact.get("remote_capability") is None
    assert _offered(ProducerScheduler(_cfg("kv_producer", "P0"), [16, 16], GroupIds(0, 1)), contact) == ["r"]


@pytest.mark.timeout(120)
def test_p_reads_are_never_offered_to_another_d_behind_a_redirected_port(
    make_sfa_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real P child and two D instances (127.0.0.1), the secret on all: a signed contact aimed at the
    other D's port (host and port are not signed), whose live request has the same id, reads nothing there."""
    monkeypatch.setenv(SECRET_ENV, "e1" * 32)  # the P child inherits it; the D instances read it
    pair = make_sfa_pair(own_process=True, d_extra={"recv_timeout_s": 3.0})
    other_extra = {**pair.extra, "kv_port": free_port_range(1), "recv_timeout_s": 3.0}
    spec = {"layers": 3, "block_size": 8, "num_blocks": 48, "main_dims": (32, 8), "indexer_dims": (8,)}
    other_cfg = SfaConfig.from_kv_transfer_config(
        engine_id="D-other",
        kv_role="kv_consumer",
        kv_port=other_extra["kv_port"],
        extra=other_extra,
        model="synthetic-sfa",
        dtype="int16",
    )
    other = SfaDInstance(other_cfg, SfaModel(**spec), get_engine("127.0.0.1"))
    try:
        mine = pair.d.decode("mine", 24)
        other.decode("mine", 24)  # the other D's own live request of the same id
        redirected = {**mine, "remote_port": other_extra["kv_port"]}
        pair.p.prefill([{"rid": "p-mine", "prompt_len": 24, "seed": 7, "params": redirected, "chunk": 0}])
        errors = other.wait_recv({"mine"}, timeout_s=20.0)
        assert errors, "the other D reported its request loaded from reads P made for another D"
    finally:
        other.shutdown()
