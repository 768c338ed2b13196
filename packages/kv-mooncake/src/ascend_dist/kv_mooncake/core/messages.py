"""Every message of the pull connector that crosses a process: msgspec Structs, tagged unions.

Runs in: P workers (server side), D workers (client side), schedulers (``kv_transfer_params``).
Nothing is pickled. The side channel is request/reply over `ascend_dist.common.zmq_server`:

| request (D -> P) | reply (P -> D) |
|---|---|
| `GetMeta` (D's `Handshake`) | `MetaReply` (P's handshake + `AgentMetadata`) or `Refused` |
| `Renew` (extend the lease of a request's blocks) | `Ack` |
| `Done` (D finished with a request, ok or not) | `Ack` |

Schema evolution follows `ascend_dist.common.wire`: new fields get defaults; an incompatible change
bumps `PROTOCOL_VERSION`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.wire import Codec, Handshake
from ascend_dist.kv_mooncake.core.admission import Count, Port, Text, check_host, convert_params

__all__ = [
    "prompt_digest",
    "PROTOCOL",
    "PROTOCOL_VERSION",
    "Ack",
    "AgentMetadata",
    "Done",
    "GetMeta",
    "MetaReply",
    "Refused",
    "Renew",
    "TensorMeta",
    "TransferParams",
    "parse_transfer_params",
    "reply_codec",
    "request_codec",
]

PROTOCOL = "kv-mooncake/pull"
PROTOCOL_VERSION = 1


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """One registered KV tensor: ``[base, block_len, stride, tokens, heads, head_bytes, head_major]``.

    ``head_major``: the block is ``[heads][tokens][content]`` (vLLM's HND layouts), not
    ``[tokens][heads][content]``; absent on the wire means token-major.
    """

    base: int
    block_len: int
    stride: int
    tokens: int
    heads: int
    head_bytes: int
    head_major: bool = False


class AgentMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """What a P worker tells D about its KV cache.

    Attributes:
        engine_id: P's engine id.
        te_session: Mooncake session id ``"<host>:<rpc_port>"``.
        tp_rank: P worker's tp rank.
        pp_rank: P worker's pp rank.
        block_size: Tokens per logical block.
        num_blocks: Logical blocks per tensor.
        layers: Layer name -> its tensors (K, V or MLA parts) in order.
    """

    engine_id: str
    te_session: str
    tp_rank: int
    pp_rank: int
    block_size: int
    num_blocks: int
    layers: dict[str, list[TensorMeta]]


class GetMeta(msgspec.Struct, frozen=True, kw_only=True, tag="get_meta"):
    """D asks for a P worker's metadata, presenting its handshake."""

    handshake: Handshake
    engine_id: str


class Renew(msgspec.Struct, frozen=True, kw_only=True, tag="renew"):
    """D is about to pull these requests: P extends their leases."""

    request_ids: list[str]


class Done(msgspec.Struct, frozen=True, kw_only=True, tag="done"):
    """D rank ``d_rank`` finished pulling ``request_id`` (successfully or not)."""

    request_id: str
    d_rank: int
    ok: bool = True


class MetaReply(msgspec.Struct, frozen=True, kw_only=True, tag="meta"):
    """P's answer to `GetMeta`."""

    handshake: Handshake
    metadata: AgentMetadata


class Refused(msgspec.Struct, frozen=True, kw_only=True, tag="refused"):
    """P refused D's handshake; ``field`` names the first difference."""

    field: str
    local: str
    remote: str


class Ack(msgspec.Struct, frozen=True, kw_only=True, tag="ack"):
    """Acknowledges `Renew` or `Done`; ``known`` says whether P tracked the request."""

    known: bool = True


Request = GetMeta | Renew | Done
Reply = MetaReply | Refused | Ack


def request_codec(max_bytes: int) -> Codec[Request]:
    """Codec of D -> P messages."""
    return Codec(Request, max_bytes=max_bytes)


def reply_codec(max_bytes: int) -> Codec[Reply]:
    """Codec of P -> D replies."""
    return Codec(Reply, max_bytes=max_bytes)


class TransferParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """``kv_transfer_params`` P returns through the proxy to D.

    ``remote_block_ids`` has one list per KV-cache group (P's logical ids, already trimmed).
    ``remote_window_blocks`` (blocks kept per sliding-window group, 0 for others) and
    ``remote_state_groups`` let D refuse to pair groups it sees differently (D then recomputes).
    ``remote_prompt_digest`` binds the params to the prompt P computed (its first
    ``remote_prompt_tokens`` tokens, see `prompt_digest`): D pulls only for that prompt.
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
    return params


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (first 32 hex digits) of prompt token ids as little-endian int64.

    P puts it in its params; D pulls only when its own prompt has the same digest, so params
    replayed onto another prompt, or copied from another client's request, never read that KV.
    """
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:32]
