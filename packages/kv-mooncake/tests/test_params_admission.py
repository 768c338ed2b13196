"""The ``kv_transfer_params`` boundary without an engine: `admission` and each scheduler's ``check_params``.

A hypothesis sweep feeds arbitrary JSON-like values (and near-valid params with one key replaced by
one) to every parse function and every check of the three connectors, both roles: they return or
raise `ConfigError`, nothing else; `ParamsGate.admit` never raises and either keeps the params or
drops them with one warning. Tables pin what each check refuses, naming the key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.admission import ParamsGate, Preview, check_host, check_url
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.messages import TransferParams, parse_transfer_params
from ascend_dist.kv_mooncake.pull.scheduler import PullScheduler, SchedRequest
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.messages import PushParams, parse_push_params
from ascend_dist.kv_mooncake.push.scheduler import LayerwiseScheduler
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.messages import ContactInfo, parse_contact
from ascend_dist.kv_mooncake.sfa.plan import GroupIds
from ascend_dist.kv_mooncake.sfa.scheduler import ConsumerScheduler, ProducerScheduler

TOPOLOGY: dict[str, Any] = {"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}}
PROMPT = 40


class _Sink:
    """A `ContactSink` that only counts (D's SFA scheduler never posts during a check)."""

    def __init__(self) -> None:
        self.posts = 0

    def post(self, ext_id: str, contact: ContactInfo, url: str | None = None) -> None:
        self.posts += 1

    def cancel(self, ext_id: str) -> None:
        pass


class _Metaserver:
    """A `Metaserver` that never connects (the layer-wise D scheduler's announcer never runs here)."""

    def post(self, url: str, payload: Mapping[str, Any]) -> None:
        pass


def _pull(role: str) -> PullScheduler:
    config = PullConfig.from_kv_transfer_config(engine_id="E", kv_role=role, kv_port=40000, extra=TOPOLOGY)
    return PullScheduler(config, [16])


def _layerwise(role: str) -> LayerwiseScheduler:
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}
    config = LayerwiseConfig.from_kv_transfer_config(engine_id="E", kv_role=role, kv_port=40000, extra=extra)
    return LayerwiseScheduler(config, [16], metaserver=_Metaserver())


def _sfa(role: str) -> SfaConfig:
    extra = {"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}, "transfer_backend": "mooncake"}
    return SfaConfig.from_kv_transfer_config(
        engine_id="E", kv_role=role, kv_port=40000, extra=extra, model="m", dtype="bf16"
    )


PULL_D, PULL_P = _pull("kv_consumer"), _pull("kv_producer")
LW_D, LW_P = _layerwise("kv_consumer"), _layerwise("kv_producer")
SFA_D = ConsumerScheduler(_sfa("kv_consumer"), [16, 16], GroupIds(0, 1), _Sink())
SFA_P = ProducerScheduler(_sfa("kv_producer"), [16, 16], GroupIds(0, 1))

Check = Callable[[Any], object]
CHECKS: dict[str, Check] = {
    "parse_transfer_params": parse_transfer_params,
    "parse_push_params": parse_push_params,
    "parse_contact": parse_contact,
    "pull-d": lambda raw: PULL_D.check_params("r", raw, PROMPT),
    "pull-p": lambda raw: PULL_P.check_params("r", raw, PROMPT),
    "layerwise-d": lambda raw: LW_D.check_params("r", raw, PROMPT),
    "layerwise-p": lambda raw: LW_P.check_params("r", raw, PROMPT),
    "sfa-d": lambda raw: SFA_D.check_params("r", raw, PROMPT),
    "sfa-p": lambda raw: SFA_P.check_params("r", raw, PROMPT),
}

GOOD: list[dict[str, Any]] = [
    {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "p1",
        "remote_host": "127.0.0.1",
        "remote_port": 40000,
        "remote_block_ids": [[3, 4, 5]],
        "remote_ptp_size": 2,
    },
    {"do_remote_decode": True},
    {"do_remote_prefill": True, "metaserver": "http://127.0.0.1:8000/v1/metaserver"},
    {
        "request_id": "r",
        "do_remote_decode": True,
        "remote_engine_id": "D",
        "remote_host": "10.0.0.2",
        "remote_port": 40000,
        "remote_block_ids": [[1, 2, 3]],
        "remote_tp_size": 1,
    },
]
KEYS = sorted(
    {*TransferParams.__struct_fields__, *PushParams.__struct_fields__, *ContactInfo.__struct_fields__}
    | {"metaserver", "batch_kv_transfer_params"}
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["http://x/", "file:///etc/passwd", "127.0.0.1", "", "true", "65535", "h" * 300])
)
json_like = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
params_like = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), json_like, max_size=6)
near_valid = st.builds(
    lambda good, key, value: {**good, key: value}, st.sampled_from(GOOD), st.sampled_from(KEYS), json_like
)
anything = json_like | params_like | near_valid


@settings(max_examples=300, deadline=None)
@given(raw=anything)
def test_every_check_raises_only_the_typed_error(raw: Any) -> None:
    for name, check in CHECKS.items():
        try:
            check(raw)
        except ConfigError as exc:
            assert exc.field.startswith("kv_transfer_params"), (name, exc.field)
            assert len(str(exc)) < 2000, (name, len(str(exc)))  # the value is repr-truncated


@settings(max_examples=200, deadline=None)
@given(raw=anything)
def test_the_gate_never_raises_and_keeps_or_drops(raw: Any) -> None:
    gate = ParamsGate("T", PULL_D.check_params, TransferParams.__struct_fields__)
    req = SchedRequest("r", PROMPT, raw)
    accepted = gate.accepts("r", raw, PROMPT)
    assert gate.admit(req, PROMPT) is accepted
    assert req.kv_transfer_params is (raw if accepted else None)


def test_good_params_pass_their_checks() -> None:
    assert PULL_D.check_params("r", GOOD[0], PROMPT).remote_block_ids == [[3, 4, 5]]
    assert PULL_P.check_params("r", GOOD[1], PROMPT).do_remote_decode
    assert LW_D.check_params("r", GOOD[2], PROMPT) is None and SFA_D.check_params("r", GOOD[2], PROMPT) is None
    assert LW_P.check_params("r", GOOD[3], PROMPT) is not None
    contact = {**GOOD[3], "remote_port": 40000}
    assert SFA_P.check_params("r", contact, PROMPT) is not None


@pytest.mark.parametrize(
    ("check", "raw", "key"),
    [
        ("pull-d", {**GOOD[0], "remote_port": "abc"}, "remote_port"),
        ("pull-d", {**GOOD[0], "remote_port": 65535}, "remote_port"),  # P's 2 TP ranks need 2 ports
        ("pull-d", {**GOOD[0], "remote_ptp_size": 4}, "remote_ptp_size"),
        ("pull-d", {**GOOD[0], "remote_block_ids": [list(range(6))]}, "remote_block_ids[0]"),  # 3 + 2 allowed
        ("pull-d", {**GOOD[0], "remote_block_ids": [[1], [2]]}, "remote_block_ids"),
        ("pull-d", {**GOOD[0], "remote_block_ids": [[2**31]]}, "remote_block_ids"),
        ("pull-d", {**GOOD[0], "remote_host": "a b"}, "remote_host"),
        ("pull-d", {**GOOD[0], "do_remote_prefill": "false"}, "do_remote_prefill"),
        ("pull-d", {"do_remote_decode": True}, "do_remote_decode"),
        ("pull-d", {**GOOD[0], 7: 1}, "kv_transfer_params"),
        ("pull-p", GOOD[0], "do_remote_prefill"),
        ("pull-p", {"do_remote_decode": True, "remote_request_id": "r" * 300}, "remote_request_id"),
        ("layerwise-d", {**GOOD[2], "metaserver": "ftp://x/"}, "metaserver"),
        ("layerwise-d", {**GOOD[2], "metaserver": "http://x:99999/"}, "metaserver"),
        ("layerwise-d", {**GOOD[2], "metaserver": "http:///nohost"}, "metaserver"),
        ("layerwise-p", {**GOOD[3], "remote_dcp_size": 2}, "remote_dcp_size"),
        ("layerwise-p", {**GOOD[3], "remote_block_ids": [list(range(6))]}, "remote_block_ids[0]"),
        ("sfa-d", {"do_remote_prefill": True}, "metaserver"),
        ("sfa-p", {**GOOD[3], "remote_tp_size": 2}, "remote_tp_size"),
        ("sfa-p", {**GOOD[3], "remote_port": 70000}, "remote_port"),
    ],
)
def test_checks_name_the_key(check: str, raw: dict[Any, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        CHECKS[check](raw)
    assert info.value.field == (key if key == "kv_transfer_params" else f"kv_transfer_params.{key}")


def test_a_virtual_sfa_request_needs_no_metaserver() -> None:
    assert SFA_D.check_params("r", {"do_remote_prefill": True, "do_virtual": True}, PROMPT) is None


def test_preview_is_short_for_huge_and_deep_values() -> None:
    deep: list[Any] = []
    inner = deep
    for _ in range(10_000):
        inner.append([])
        inner = inner[0]
    assert len(repr(Preview("x" * 1_000_000))) < 80
    assert len(repr(Preview(deep))) < 80
    assert len(repr(Preview({str(i): i for i in range(10_000)}))) < 200


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[fe80::1]", "p-0.cluster.local", "node_3"])
def test_hosts_accepted(host: str) -> None:
    check_host("remote_host", host)


@pytest.mark.parametrize("host", ["", "a b", "h:1", "tcp://x", "x;y", "a" * 254, "-x.", "é.com"])
def test_hosts_refused(host: str) -> None:
    with pytest.raises(ConfigError, match=r"kv_transfer_params\.remote_host"):
        check_host("remote_host", host)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://x/", "http://", "http://a b/", "x" * 3000, None, 5])
def test_urls_refused(url: Any) -> None:
    with pytest.raises(ConfigError, match=r"kv_transfer_params\.metaserver"):
        check_url("metaserver", url)


def test_the_gate_warns_once_per_request_and_once_per_unknown_key(caplog: pytest.LogCaptureFixture) -> None:
    gate = ParamsGate("T", PULL_D.check_params, TransferParams.__struct_fields__)
    caplog.set_level(logging.WARNING, logger="ascend_dist")
    bad = SchedRequest("bad", PROMPT, {**GOOD[0], "remote_port": "z" * 10_000})
    assert not gate.admit(bad, PROMPT) and bad.kv_transfer_params is None
    assert gate.admit(bad, PROMPT)  # now a plain local request: nothing more is logged
    (record,) = caplog.records
    assert "kv_transfer_params.remote_port" in record.getMessage() and len(record.getMessage()) < 600
    caplog.clear()
    for rid in ("a", "b"):
        assert gate.admit(SchedRequest(rid, PROMPT, {**GOOD[0], "aborted_request": [], "surprise": 1}), PROMPT)
    (record,) = caplog.records
    assert "surprise" in record.getMessage() and "aborted_request" not in record.getMessage()


@pytest.mark.parametrize("check", ["layerwise-d", "sfa-d"])
def test_a_metaserver_on_a_host_the_operator_did_not_configure_is_refused(check: str) -> None:
    raw = {**GOOD[2], "do_remote_prefill": True, "metaserver": "http://collector.example:8000/v1/metaserver"}
    with pytest.raises(ConfigError) as info:
        CHECKS[check](raw)
    assert info.value.field == "kv_transfer_params.metaserver" and "metaserver_hosts" in info.value.expected
    CHECKS[check]({**raw, "metaserver": "http://127.0.0.1:8000/v1/metaserver"})  # control: loopback is configured


def test_configured_metaserver_hosts_are_the_only_ones_allowed() -> None:
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "metaserver_hosts": "proxy-0.cluster, 10.0.0.7"}
    config = LayerwiseConfig.from_kv_transfer_config(engine_id="E", kv_role="kv_consumer", kv_port=40000, extra=extra)
    assert config.metaserver_hosts == ("proxy-0.cluster", "10.0.0.7")
    d = LayerwiseScheduler(config, [16], metaserver=_Metaserver())
    raw = {**GOOD[2], "do_remote_prefill": True}
    d.check_params("r", {**raw, "metaserver": "http://PROXY-0.cluster:80/m"}, PROMPT)
    with pytest.raises(ConfigError):
        d.check_params("r", {**raw, "metaserver": "http://127.0.0.1/m"}, PROMPT)


def test_max_message_bytes_is_capped() -> None:
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "max_message_bytes": 1 << 40}
    with pytest.raises(ConfigError) as info:
        LayerwiseConfig.from_kv_transfer_config(engine_id="E", kv_role="kv_consumer", kv_port=40000, extra=extra)
    assert "max_message_bytes" in info.value.field
