"""The layer-wise push's wire: its side channel (P asks, **D serves**) and the params D announces.

Runs in: D workers (server side), P workers (client side, on the send thread), schedulers (the
metaserver payload). Built on the shared vocabulary of `ascend_dist.kv_mooncake.core.messages`;
one request/reply exchange over `ascend_dist.common.zmq_server` per message:

| request (P -> D) | reply (D -> P) |
|---|---|
| `GetMeta` (P's `Handshake`) | `MetaReply` (D's handshake + `AgentMetadata`) or `Refused` |
| `Claim` (``sender`` will write these requests: each step, before its writes) | `Ack` (``unknown``: write none) |
| `LayerDone` (these layers of these requests are in D's blocks) | `Ack` (``unknown``: ids D gave up on) |
| `PushDone` (this ``sender`` finished a request, ``ok`` or failed with ``reason``) | `Ack` |

A claim is D's fence: D only hands a failed request's blocks back to vLLM (which recomputes into
them) once every sender that claimed it sent its `PushDone`, so no claimed write can land later;
a sender that did not claim before D gave up is answered ``unknown`` and writes nothing.
D counts a request as received when ``trans_count`` distinct senders sent ``PushDone(ok=True)``
(duplicates from one sender do not over-count). The params carry `core.wire.WIRE_VERSION` too.
Every field is bounded (ids, layer numbers, counts, list lengths) so a frame is refused before D
allocates anything for it, and `PushDone` has push's own tag: pull's `core.messages.Done` never
decodes here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.admission import Count, ParallelSize, Port, Text, check_host, convert_params
from ascend_dist.kv_mooncake.core.capability import Tag, WallMs
from ascend_dist.kv_mooncake.core.messages import Ack, GetMeta, MetaReply, Refused, WireText
from ascend_dist.kv_mooncake.core.wire import WIRE_VERSION, Channel
from ascend_dist.kv_mooncake.core.wire import Request as _Request

__all__ = [
    "CHANNEL",
    "Claim",
    "MAX_LAYERS",
    "LayerDone",
    "PushDone",
    "PushParams",
    "Reply",
    "Request",
    "external_request_id",
    "parse_push_params",
    "reply_codec",
    "request_codec",
]


MAX_LAYERS = 4096
"""Largest layer count (and request ids per message) a layer-wise frame may name."""
LayerNo = Annotated[int, msgspec.Meta(ge=0, lt=MAX_LAYERS)]
Senders = Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]


class Claim(_Request, frozen=True, kw_only=True, tag="push_claim"):
    """P rank ``sender`` is about to write ``request_ids`` into D's blocks (D answers the ids it gave up on)."""

    sender: WireText
    request_ids: Annotated[list[WireText], msgspec.Meta(max_length=MAX_LAYERS)]


class LayerDone(_Request, frozen=True, kw_only=True, tag="layer_done"):
    """P rank ``sender`` wrote ``layers`` of ``request_ids`` into D's blocks."""

    sender: WireText
    layers: Annotated[list[LayerNo], msgspec.Meta(max_length=MAX_LAYERS)]
    request_ids: Annotated[list[WireText], msgspec.Meta(max_length=MAX_LAYERS)]
    trans_count: Senders


class PushDone(_Request, frozen=True, kw_only=True, tag="push_done"):
    """P rank ``sender`` finished ``request_id``: successfully (``ok``) or not (``reason``).

    Attributes:
        request_id: D's external id of the request.
        ok: Whether the sender's pushes all landed.
        reason: Why it failed (empty when ``ok``).
        sender: P's rank identity; D counts ``trans_count`` distinct senders.
        trans_count: How many senders D waits for before the request is received.
    """

    request_id: WireText
    ok: bool
    sender: WireText
    trans_count: Senders
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""


Request = GetMeta | Claim | LayerDone | PushDone
Reply = MetaReply | Refused | Ack

CHANNEL = Channel("kv-mooncake/layerwise", Request, Reply)
request_codec, reply_codec = CHANNEL.request_codec, CHANNEL.reply_codec  # P -> D; D -> P


class PushParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """``kv_transfer_params`` D's scheduler posts to the metaserver and the proxy hands to P.

    ``remote_block_ids`` has one list per KV-cache group (D's logical ids, prefix-hit blocks included).
    ``remote_prompt_digest`` (of D's first ``remote_prompt_tokens`` prompt tokens): P pushes only for
    that prompt, so params copied from another request cannot overwrite its blocks.
    ``remote_capability`` (hex) is D's signature over ``request_id``, ``remote_engine_id``,
    ``remote_block_ids``, the prompt digest and ``remote_capability_expires`` (wall ms), with a
    deployment secret (`core.capability`): P writes only into blocks D signed for that request.
    Every field is bounded (`Text`, `Count`, `ParallelSize`): P receives them from the proxy's clients.
    """

    request_id: Text
    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: Text
    remote_host: Text
    remote_port: Port
    remote_block_ids: list[list[Count]]
    remote_block_size: list[Count] = []
    remote_tp_size: ParallelSize = 1
    remote_pcp_size: ParallelSize = 1
    remote_dcp_size: ParallelSize = 1
    remote_cached_tokens: Count = 0
    protocol_version: int = WIRE_VERSION
    remote_prompt_tokens: Count | None = None
    remote_prompt_digest: Text | None = None
    remote_capability: Tag | None = None
    remote_capability_expires: WallMs | None = None


_VLLM_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(request_id: str) -> str:
    """The id the client and the proxy know: vLLM's internal id without its random suffix.

    vLLM 0.33 makes request ids unique per engine as ``f"{external}-{8 hex}"`` (unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``), so P's and D's internal ids of one request differ; the
    proxy matches D's announcement to P's request by the external id. An id without
    such a suffix is its own external id.
    """
    return _VLLM_SUFFIX.sub("", request_id)


def parse_push_params(raw: Mapping[str, Any]) -> PushParams:
    """Validate the params P receives from the proxy (types, ranges, lengths; flags must be booleans).

    Raises:
        ConfigError: A key is missing or has the wrong type or range; names ``kv_transfer_params.<key>``.
    """
    params = convert_params(raw, PushParams)
    check_host("remote_host", params.remote_host)
    if params.protocol_version != WIRE_VERSION:
        raise ConfigError("kv_transfer_params.protocol_version", params.protocol_version, str(WIRE_VERSION))
    return params
