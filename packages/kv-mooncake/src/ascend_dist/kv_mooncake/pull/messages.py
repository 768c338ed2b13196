"""The pull connector's wire: its side channel (D asks, P serves) and the params P hands D.

Runs in: P workers (server side), D workers (client side), schedulers (``kv_transfer_params``).
Built on the shared vocabulary of `ascend_dist.kv_mooncake.core.messages`; one request/reply
exchange over `ascend_dist.common.zmq_server` per message:

| request (D -> P) | reply (P -> D) |
|---|---|
| `GetMeta` (D's `Handshake`) | `MetaReply` (P's handshake + `AgentMetadata`) or `Refused` |
| `Renew` (extend the leases of up to `MAX_BATCH` requests' blocks) | `Held` (per request id: a flag, a lease) |
| `Dones` (D finished with up to `MAX_BATCH` requests, each ok or not) | `Ack` |
| `Done` (one request; kept for tools and tests) | `Ack` |

D's receive path batches per P rank: one `Renew` for every request of a read batch before the read
(a second one after it only when the read outlasted half the lease P promised) and one `Dones` for
the requests it finished (`pull.threads`).

Readers: each D pull names itself with a random token (``Renew.readers``, ``DoneItem.reader``). P
binds each request's ``(d_rank, sender)`` slot to the first reader that names it and then renews
for, and counts DONEs from, that reader only: a second D request presenting the same params (a
client replaying them) is told "not held" before it reads, and its DONE cannot free blocks the
first one still reads. That, with the lease P promises in `Held.lease_s`, is what lets D skip the
check after a read that ended well inside the lease.

With a deployment secret, P signs the params it hands out (`core.capability`: request id, engine
id, block ids, prompt digest, expiry; ``remote_capability`` and ``remote_capability_expires``) and
D presents that `Grant` in every `Renew` (``grants``, one per request id) and `Dones` item (``grant``):
P holds, renews or frees only what it signed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.admission import Count, Port, Text, check_host, convert_params
from ascend_dist.kv_mooncake.core.capability import MAX_RANK_HOSTS, Grant, Tag, WallMs
from ascend_dist.kv_mooncake.core.messages import Ack, Done, GetMeta, MetaReply, Rank, Refused, WireText
from ascend_dist.kv_mooncake.core.wire import Channel, Message
from ascend_dist.kv_mooncake.core.wire import Request as _Request

__all__ = [
    "CHANNEL",
    "MAX_BATCH",
    "DoneItem",
    "Dones",
    "Held",
    "Renew",
    "Reply",
    "Request",
    "TransferParams",
    "parse_transfer_params",
    "reply_codec",
    "request_codec",
]


MAX_BATCH = 64
"""Most request ids in one `Renew`, `Held` or `Dones` (a grant carries the request's block ids, so
64 of them stay well inside the default ``max_message_bytes`` of 4 MiB); D splits larger batches."""


class Renew(_Request, frozen=True, kw_only=True, tag="renew"):
    """D is about to pull (or has just pulled) these requests: P extends their leases.

    ``grants``: with a deployment secret, the capability P signed for each request id (same
    order); P answers "not held" for any that does not verify (for all of them when the two lists
    differ in length). ``senders`` and ``readers`` (same order, or empty: ``""`` each) name the D
    task (beside ``d_rank``, as its DONE will) and the D pull's token: P answers "not held" to a
    reader other than the one that slot is bound to.
    """

    request_ids: Annotated[list[WireText], msgspec.Meta(max_length=MAX_BATCH)]
    grants: Annotated[list[Grant], msgspec.Meta(max_length=MAX_BATCH)] = msgspec.field(default_factory=list)
    d_rank: Rank = 0
    senders: Annotated[list[WireText], msgspec.Meta(max_length=MAX_BATCH)] = msgspec.field(default_factory=list)
    readers: Annotated[list[WireText], msgspec.Meta(max_length=MAX_BATCH)] = msgspec.field(default_factory=list)


LeaseSeconds = Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)]


class Held(Message, frozen=True, kw_only=True, tag="pull_held"):
    """P's answer to `Renew`: ``held[i]`` is whether P still holds ``request_ids[i]``'s blocks.

    ``lease_s[i]`` (or empty: no promise) is how long from its answer P keeps those blocks at the
    least: the renewed lease of a lent request, 0 for one still in P's batch (its lease has not
    begun) or not held. ``incarnation`` is the answering worker process's (`AgentMetadata`'s; empty
    from a P that does not say): D reads with the metadata it cached only while they match.
    """

    held: Annotated[list[bool], msgspec.Meta(max_length=MAX_BATCH)]
    lease_s: Annotated[list[LeaseSeconds], msgspec.Meta(max_length=MAX_BATCH)] = msgspec.field(default_factory=list)
    incarnation: Annotated[str, msgspec.Meta(max_length=64)] = ""


class DoneItem(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a `Dones`: the fields of `core.messages.Done` but the rank."""

    request_id: WireText
    ok: bool
    sender: WireText = ""
    grant: Grant | None = None
    reader: WireText = ""


class Dones(_Request, frozen=True, kw_only=True, tag="pull_dones"):
    """D rank ``d_rank`` finished with these requests.

    P counts each ``(request, d_rank, sender)`` once, and only from the reader that slot is bound to.
    """

    d_rank: Rank
    items: Annotated[list[DoneItem], msgspec.Meta(max_length=MAX_BATCH)]


Request = GetMeta | Renew | Done | Dones
Reply = MetaReply | Refused | Ack | Held

CHANNEL = Channel("kv-mooncake/pull", Request, Reply)
request_codec, reply_codec = CHANNEL.request_codec, CHANNEL.reply_codec  # D -> P; P -> D


class TransferParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """``kv_transfer_params`` P returns through the proxy to D.

    ``remote_block_ids`` has one list per KV-cache group (P's logical ids, already trimmed).
    ``remote_window_blocks`` (blocks kept per sliding-window group, 0 for others) and
    ``remote_state_groups`` let D refuse to pair groups it sees differently (D then recomputes).
    ``remote_prompt_digest`` binds the params to the prompt P computed (its first
    ``remote_prompt_tokens`` tokens, see `prompt_digest`): D pulls only for that prompt.
    ``remote_capability`` (hex) is P's signature over the request id, engine id, block ids, prompt
    digest and ``remote_capability_expires`` (wall ms), with a deployment secret (`core.capability`).
    ``remote_rank_hosts`` (a P instance whose ranks span nodes): entry ``i`` is the host of P's
    side channel and Mooncake segment on port ``remote_port + i`` ("" or past the end:
    ``remote_host``); P fills it from its workers' handshake metadata and signs it with the rest.
    Every field is bounded (strings `Text`, counts and ids `Count`): the params come from clients.
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_engine_id: Text | None = None
    remote_request_id: Text | None = None
    remote_host: Text | None = None
    remote_port: Port | None = None
    remote_block_ids: list[list[Count]] | None = None
    remote_ptp_size: Count | None = None
    remote_block_size: Count | None = None
    num_prompt_blocks: Count = 0
    num_computed_tokens: Count = 0
    last_token_id: Count | None = None
    do_virtual: bool = False
    remote_window_blocks: list[Count] | None = None
    remote_state_groups: list[Count] | None = None
    remote_prompt_tokens: Count | None = None
    remote_prompt_digest: Text | None = None
    remote_capability: Tag | None = None
    remote_capability_expires: WallMs | None = None
    remote_rank_hosts: Annotated[list[Text], msgspec.Meta(max_length=MAX_RANK_HOSTS)] | None = None


_REQUIRED_FOR_PULL = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids")


def parse_transfer_params(raw: Mapping[str, Any]) -> TransferParams:
    """Validate a ``kv_transfer_params`` dict (types, ranges, lengths; flags must be booleans).

    Raises:
        ConfigError: A key has the wrong type or range, or a key D needs to pull is missing; the
            error names ``kv_transfer_params.<key>``.
    """
    params = convert_params(raw, TransferParams)
    if params.do_remote_prefill:
        for key in _REQUIRED_FOR_PULL:
            if getattr(params, key) is None:
                raise ConfigError(f"kv_transfer_params.{key}", None, "present when do_remote_prefill is true")
        check_host("remote_host", params.remote_host or "")
        for i, host in enumerate(params.remote_rank_hosts or []):
            if host:
                check_host(f"remote_rank_hosts[{i}]", host)
    return params
