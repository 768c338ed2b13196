"""Signed transfer capabilities: exactly which of a peer's KV blocks a transfer may touch, and for how long.

Runs in: pull's schedulers (P signs the params it hands out) and workers (D checks before any
read; P checks every ``Renew`` and ``Done``), and push's (D signs the blocks P may write; P checks
before writing). The params that name blocks travel through API clients and proxies, so without a
signature any client could edit ``remote_block_ids`` and read (or overwrite) another request's KV.

A `Capability` is the request id, the engine id of the side that owns the blocks, the exact block
ids per KV-cache group, the prompt digest, an expiry (wall-clock milliseconds: P and D are
different hosts) and, for a pull from a P instance spanning nodes, the host of each P rank's port
(``hosts``, empty otherwise): a client cannot point one rank's reads at another host. Its
canonical encoding is msgspec's msgpack of the array-like Struct (one byte string for one value),
and its tag is `DeploymentSecret.sign` under a per-transport purpose (`PULL_PURPOSE`,
`PUSH_PURPOSE`, `SFA_PURPOSE`), so a tag made for one use never verifies as another, nor as a
frame MAC. The tag travels as hex in the params beside the fields it covers; the checker rebuilds
the capability from those fields, so a client can replay what it was given and nothing wider.

Without a deployment secret nothing is signed or checked (upstream's behaviour; the adapters log
`warn_unauthenticated` once). A checker with a secret refuses params without a tag.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Annotated

import msgspec

from ascend_dist.common.auth_cost import AUTH_COST
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import DeploymentSecret

__all__ = [
    "CLOCK_SKEW_S",
    "MAX_RANK_HOSTS",
    "PULL_PURPOSE",
    "PUSH_PURPOSE",
    "SFA_PURPOSE",
    "Capability",
    "CapabilityRefused",
    "Grant",
    "Tag",
    "block_lists",
    "canonical",
    "check_capability",
    "check_grant",
    "expiry_ms",
    "sign_capability",
    "wall_ms",
]

PULL_PURPOSE = "kv-mooncake/pull-capability"
"""Subkey purpose of P's signature over what D may read."""
PUSH_PURPOSE = "kv-mooncake/push-capability"
"""Subkey purpose of D's signature over what P may write."""
SFA_PURPOSE = "kv-mooncake/sfa-capability"
"""Subkey purpose of SFA D's signature over its contact (which D request P's reads are for)."""
CLOCK_SKEW_S = 30.0
"""Added to every expiry: the signer's and the checker's wall clocks may disagree by this much."""
MAX_RANK_HOSTS = 4096
"""Most P ports (TP x PP x PCP of one DP rank) a capability's ``hosts`` names."""
TAG_HEX = 64
"""Hex digits of a tag (HMAC-SHA256)."""

Tag = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]*$", max_length=TAG_HEX)]
"""A tag as hex on the wire or in params ("" = none)."""
_BlockId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
_Text = Annotated[str, msgspec.Meta(max_length=256)]
WallMs = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
"""Wall-clock milliseconds since the epoch."""


class Capability(msgspec.Struct, frozen=True, array_like=True):
    """What the owner of some KV blocks lets one transfer touch (see the module)."""

    request_id: _Text
    engine_id: _Text
    block_ids: list[list[_BlockId]]
    prompt_digest: _Text
    expires_ms: WallMs
    hosts: Annotated[list[_Text], msgspec.Meta(max_length=MAX_RANK_HOSTS)] = []


class Grant(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A capability with its tag, as D presents it to P in ``Renew`` and ``Done``."""

    capability: Capability
    tag: Tag


_ENCODER = msgspec.msgpack.Encoder()


class CapabilityRefused(ConfigError):
    """A capability did not verify; ``field`` names the params key (or message field) that is wrong."""


def wall_ms(clock: Callable[[], float] = time.time) -> int:
    """``clock()`` (wall seconds) in milliseconds."""
    return int(clock() * 1000)


def expiry_ms(valid_s: float, clock: Callable[[], float] = time.time) -> int:
    """The expiry of a capability signed now and usable for ``valid_s`` seconds (plus `CLOCK_SKEW_S`)."""
    return wall_ms(clock) + int((valid_s + CLOCK_SKEW_S) * 1000)


def canonical(capability: Capability) -> bytes:
    """The signed bytes: one encoding per value (array-like msgpack, ids as given)."""
    return _ENCODER.encode(capability)


def sign_capability(secret: DeploymentSecret, purpose: str, capability: Capability) -> str:
    """The tag of ``capability`` under ``purpose``, as hex."""
    started = AUTH_COST.start()
    tag = secret.sign(purpose, canonical(capability)).hex()
    AUTH_COST.add(started)
    return tag


def check_capability(
    secret: DeploymentSecret,
    purpose: str,
    capability: Capability,
    tag: str | None,
    *,
    field: str,
    now_ms: int | None,
) -> None:
    """Refuse ``capability`` unless ``tag`` is its signature under ``purpose`` and it has not expired.

    Args:
        secret: The deployment secret.
        purpose: `PULL_PURPOSE` or `PUSH_PURPOSE`.
        capability: The capability as the presented fields claim it.
        tag: Its presented tag (hex; None or "" = absent).
        field: The key that carries the tag where it came from (``kv_transfer_params.remote_capability``),
            named by the error; the expiry is named as ``<field>_expires``.
        now_ms: Wall-clock milliseconds to check the expiry against; None skips it (a ``Done``
            may release blocks after the capability expired).

    Raises:
        CapabilityRefused: No tag, a tag that does not verify (any covered field differs from
            what was signed), or an expired capability.
    """
    if not tag:
        raise CapabilityRefused(field, None, "present: this deployment signs transfer capabilities")
    try:
        raw = bytes.fromhex(tag)
    except ValueError:
        raise CapabilityRefused(field, tag[:16], "a hex tag") from None
    started = AUTH_COST.start()
    verified = secret.verify(purpose, canonical(capability), raw)
    AUTH_COST.add(started)
    if not verified:
        raise CapabilityRefused(
            field,
            tag[:16] + "...",
            "the signature of exactly this request id, engine id, block ids, prompt digest, expiry and rank hosts",
        )
    if now_ms is not None and now_ms > capability.expires_ms:
        raise CapabilityRefused(f"{field}_expires", capability.expires_ms, f"a time after now ({now_ms} ms)")


def check_grant(
    secret: DeploymentSecret, purpose: str, grant: Grant | None, *, request_id: str, engine_id: str, now_ms: int | None
) -> None:
    """Refuse ``grant`` unless it is the owner's (``engine_id``) verified capability for ``request_id``.

    What a server checks of a grant a peer presents (pull: P of each ``Renew`` and ``Done``).

    Raises:
        CapabilityRefused: Names ``grant`` (absent), ``grant.request_id``, ``grant.engine_id`` or
            ``grant.tag`` (see `check_capability`; ``now_ms`` None skips the expiry).
    """
    if grant is None:
        raise CapabilityRefused("grant", None, "present: this deployment signs transfer capabilities")
    cap = grant.capability
    if cap.request_id != request_id:
        raise CapabilityRefused("grant.request_id", cap.request_id[:64], "the request id of the message")
    if cap.engine_id != engine_id:
        raise CapabilityRefused("grant.engine_id", cap.engine_id[:64], "this server's engine id")
    check_capability(secret, purpose, cap, grant.tag, field="grant.tag", now_ms=now_ms)


def block_lists(ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """``ids`` as the plain nested lists a `Capability` encodes (tuples and lists sign the same)."""
    return [[int(b) for b in group] for group in ids]
