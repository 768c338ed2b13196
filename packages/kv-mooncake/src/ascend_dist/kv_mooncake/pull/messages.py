"""The pull connector's wire: its side channel (D asks, P serves) and the params P hands D.

Runs in: P workers (server side), D workers (client side), schedulers (``kv_transfer_params``).
Built on the shared vocabulary of `ascend_dist.kv_mooncake.core.messages`; one request/reply
exchange over `ascend_dist.common.zmq_server` per message:

| request (D -> P) | reply (P -> D) |
|---|---|
| `GetMeta` (D's `Handshake`) | `MetaReply` (P's handshake + `AgentMetadata`) or `Refused` |
| `Renew` (extend the lease of a request's blocks) | `Ack` (``known``) |
| `Done` (D finished with a request, ok or not) | `Ack` (``known``) |

With a deployment secret, P signs the params it hands out (`core.capability`: request id, engine
id, block ids, prompt digest, expiry; ``remote_capability`` and ``remote_capability_expires``) and
D presents that `Grant` in every `Renew` (``grants``, one per request id) and `Done` (``grant``):
P holds, renews or frees only what it signed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.admission import Count, Port, Text, check_host, convert_params
from ascend_dist.kv_mooncake.core.capability import MAX_RANK_HOSTS, Grant, Tag, WallMs
from ascend_dist.kv_mooncake.core.messages import Ack, Done, GetMeta, MetaReply, Refused
from ascend_dist.kv_mooncake.core.wire import Channel
from ascend_dist.kv_mooncake.core.wire import Request as _Request

__all__ = [
    "CHANNEL",
    "Renew",
    "Reply",
    "Request",
    "TransferParams",
    "parse_transfer_params",
    "reply_codec",
    "request_codec",
]


class Renew(_Request, frozen=True, kw_only=True, tag="renew"):
    """D is about to pull these requests: P extends their leases.

    ``grants``: with a deployment secret, the capability P signed for each request id (same
    order); P answers ``known=False`` for any that does not verify.
    """

    request_ids: list[str]
    grants: Annotated[list[Grant], msgspec.Meta(max_length=64)] = msgspec.field(default_factory=list)


Request = GetMeta | Renew | Done
Reply = MetaReply | Refused | Ack

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
