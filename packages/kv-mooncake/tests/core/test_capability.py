"""The capability codec: the legit capability verifies; every widened or foreign one is refused, naming the field."""

from __future__ import annotations

import msgspec
import pytest

from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.kv_mooncake.core.capability import (
    PULL_PURPOSE,
    PUSH_PURPOSE,
    Capability,
    CapabilityRefused,
    Grant,
    canonical,
    check_capability,
    check_grant,
    sign_capability,
)

SECRET = DeploymentSecret(bytes(range(32)))
NOW = 1_800_000_000_000
LEGIT = Capability("req-a", "P0", [[3, 4, 5], [9]], "d" * 32, NOW + 60_000)
FIELD = "kv_transfer_params.remote_capability"


def _check(cap: Capability, tag: str | None, *, purpose: str = PULL_PURPOSE, now: int | None = NOW) -> None:
    check_capability(SECRET, purpose, cap, tag, field=FIELD, now_ms=now)


def test_the_capability_p_signed_verifies() -> None:
    tag = sign_capability(SECRET, PULL_PURPOSE, LEGIT)
    _check(LEGIT, tag)  # control for every refusal below: the same check accepts the legit one
    _check(Capability("req-a", "P0", [[3, 4, 5], [9]], "d" * 32, NOW + 60_000), tag)  # an equal value, rebuilt
    assert len(tag) == 64


@pytest.mark.parametrize(
    "forged",
    [
        Capability("req-a", "P0", [[3, 4, 5, 6], [9]], "d" * 32, NOW + 60_000),  # widened
        Capability("req-a", "P0", [[3, 4, 17], [9]], "d" * 32, NOW + 60_000),  # same length, another block
        Capability("req-a", "P0", [[3, 4], [5, 9]], "d" * 32, NOW + 60_000),  # ids moved between groups
        Capability("req-b", "P0", [[3, 4, 5], [9]], "d" * 32, NOW + 60_000),  # another request id
        Capability("req-a", "P1", [[3, 4, 5], [9]], "d" * 32, NOW + 60_000),  # another engine
        Capability("req-a", "P0", [[3, 4, 5], [9]], "e" * 32, NOW + 60_000),  # another prompt
        Capability("req-a", "P0", [[3, 4, 5], [9]], "d" * 32, NOW + 600_000),  # a later expiry
    ],
    ids=["widened", "swapped-block", "regrouped", "request", "engine", "prompt", "expiry"],
)
def test_any_changed_field_is_refused_naming_the_tag(forged: Capability) -> None:
    tag = sign_capability(SECRET, PULL_PURPOSE, LEGIT)
    with pytest.raises(CapabilityRefused) as err:
        _check(forged, tag)
    assert err.value.field == FIELD and "block ids" in err.value.expected


def test_an_expired_capability_is_refused_naming_its_expiry() -> None:
    tag = sign_capability(SECRET, PULL_PURPOSE, LEGIT)
    with pytest.raises(CapabilityRefused) as err:
        _check(LEGIT, tag, now=LEGIT.expires_ms + 1)
    assert err.value.field == FIELD + "_expires"
    _check(LEGIT, tag, now=None)  # a Done may still release it (no expiry check asked)


def test_a_tag_of_another_purpose_or_another_secret_is_refused() -> None:
    push_tag = sign_capability(SECRET, PUSH_PURPOSE, LEGIT)
    with pytest.raises(CapabilityRefused):
        _check(LEGIT, push_tag)
    frame_mac = SECRET.sign("frame", canonical(LEGIT)).hex()  # a MAC of another use, over the same bytes
    with pytest.raises(CapabilityRefused):
        _check(LEGIT, frame_mac)
    other = sign_capability(DeploymentSecret(bytes(range(1, 33))), PULL_PURPOSE, LEGIT)
    with pytest.raises(CapabilityRefused):
        _check(LEGIT, other)


@pytest.mark.parametrize("tag", [None, "", "zz" * 32, "ab"])
def test_missing_or_malformed_tags_are_refused(tag: str | None) -> None:
    with pytest.raises(CapabilityRefused) as err:
        _check(LEGIT, tag)
    assert err.value.field == FIELD


def test_the_encoding_is_canonical_and_bounded() -> None:
    assert canonical(LEGIT) == canonical(msgspec.msgpack.decode(canonical(LEGIT), type=Capability))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(canonical(Capability("r", "P", [[-1]], "", 0)), type=Capability)


def test_a_grant_is_checked_against_the_message_and_the_server() -> None:
    grant = Grant(capability=LEGIT, tag=sign_capability(SECRET, PULL_PURPOSE, LEGIT))
    check_grant(SECRET, PULL_PURPOSE, grant, request_id="req-a", engine_id="P0", now_ms=NOW)  # control
    for kwargs, field in [
        ({"request_id": "req-b", "engine_id": "P0"}, "grant.request_id"),  # a grant for another request
        ({"request_id": "req-a", "engine_id": "P1"}, "grant.engine_id"),  # another P's grant
    ]:
        with pytest.raises(CapabilityRefused) as err:
            check_grant(SECRET, PULL_PURPOSE, grant, now_ms=NOW, **kwargs)
        assert err.value.field == field
    with pytest.raises(CapabilityRefused) as err:
        check_grant(SECRET, PULL_PURPOSE, None, request_id="req-a", engine_id="P0", now_ms=NOW)
    assert err.value.field == "grant"
    widened = Grant(capability=msgspec.structs.replace(LEGIT, block_ids=[[3, 4, 5, 6], [9]]), tag=grant.tag)
    with pytest.raises(CapabilityRefused) as err:
        check_grant(SECRET, PULL_PURPOSE, widened, request_id="req-a", engine_id="P0", now_ms=NOW)
    assert err.value.field == "grant.tag"
