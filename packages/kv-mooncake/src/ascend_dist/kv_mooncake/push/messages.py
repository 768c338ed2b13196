"""Every message of the layer-wise push that crosses a process: msgspec Structs, tagged unions.

Runs in: D workers (server side), P workers (client side, on the send thread), schedulers (the
metaserver payload). Nothing is pickled. The side channel is request/reply over
`ascend_dist.common.zmq_server`; **D serves**, P asks:

| request (P -> D) | reply (D -> P) |
|---|---|
| `GetMeta` (P's `Handshake`) | `MetaReply` (D's handshake + `DAgentMetadata`) or `Refused` |
| `LayerDone` (these layers of these requests are in D's blocks) | `Ack` (``unknown``: ids D gave up on) |
| `Done` (this sender finished a request, ``ok`` or failed) | `Ack` |

D counts a request as received when ``trans_count`` distinct senders sent ``Done(ok=True)``
(duplicates from one sender do not over-count). Schema evolution follows
`ascend_dist.common.wire`: new fields get defaults; an incompatible change bumps `PROTOCOL_VERSION`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.wire import Codec, Handshake
from ascend_dist.kv_mooncake.core.admission import Count, ParallelSize, Port, Text, check_host, convert_params
from ascend_dist.kv_mooncake.core.messages import TensorMeta

__all__ = [
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "Ack",
    "DAgentMetadata",
    "Done",
    "GetMeta",
    "LayerDone",
    "MetaReply",
    "PushParams",
    "Refused",
    "Reply",
    "Request",
    "external_request_id",
    "parse_push_params",
    "reply_codec",
    "request_codec",
]

PROTOCOL = "kv-mooncake/layerwise"
PROTOCOL_VERSION = 1


class DAgentMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """What a D worker tells P about its KV cache (P writes into it).

    Attributes:
        engine_id: D's engine id.
        te_session: Mooncake session id ``"<host>:<rpc_port>"``.
        tp_rank: D worker's tp rank.
        block_size: Tokens per logical block.
        num_blocks: Logical blocks per tensor.
        layers: Layer name -> its tensors (K and V, or MLA parts) in order.
    """

    engine_id: str
    te_session: str
    tp_rank: int
    block_size: int
    num_blocks: int
    layers: dict[str, list[TensorMeta]]


class GetMeta(msgspec.Struct, frozen=True, kw_only=True, tag="get_meta"):
    """P asks for a D worker's metadata, presenting its handshake."""

    handshake: Handshake
    engine_id: str


class LayerDone(msgspec.Struct, frozen=True, kw_only=True, tag="layer_done"):
    """P rank ``sender`` wrote ``layers`` of ``request_ids`` into D's blocks."""

    sender: str
    layers: list[int]
    request_ids: list[str]
    trans_count: int


class Done(msgspec.Struct, frozen=True, kw_only=True, tag="done"):
    """P rank ``sender`` finished ``request_id``: every layer written (``ok``) or it failed."""

    sender: str
    request_id: str
    trans_count: int
    ok: bool = True
    reason: str = ""


class MetaReply(msgspec.Struct, frozen=True, kw_only=True, tag="meta"):
    """D's answer to `GetMeta`."""

    handshake: Handshake
    metadata: DAgentMetadata


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag="refused"):
    """D refused P's handshake; ``field`` names the first difference."""

    field: str
    local: str
    remote: str


class Ack(msgspec.Struct, frozen=True, kw_only=True, tag="ack"):
    """Acknowledges `LayerDone` / `Done`; ``unknown`` lists ids D does not (or no longer) wait for."""

    unknown: list[str] = []


Request = GetMeta | LayerDone | Done
Reply = MetaReply | Refused | Ack


def request_codec(max_bytes: int) -> Codec[Request]:
    """Codec of P -> D messages."""
    return Codec(Request, max_bytes=max_bytes)


def reply_codec(max_bytes: int) -> Codec[Reply]:
    """Codec of D -> P replies."""
    return Codec(Reply, max_bytes=max_bytes)


class PushParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """``kv_transfer_params`` D's scheduler posts to the metaserver and the proxy hands to P.

    ``remote_block_ids`` has one list per KV-cache group (D's logical ids, prefix-hit blocks included).
    ``remote_prompt_digest`` (of D's first ``remote_prompt_tokens`` prompt tokens): P pushes only for
    that prompt, so params copied from another request cannot overwrite its blocks.
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
    protocol_version: int = PROTOCOL_VERSION
    remote_prompt_tokens: Count | None = None
    remote_prompt_digest: Text | None = None


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
    if params.protocol_version != PROTOCOL_VERSION:
        raise ConfigError("kv_transfer_params.protocol_version", params.protocol_version, str(PROTOCOL_VERSION))
    return params
