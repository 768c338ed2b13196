"""The messages every kv-mooncake transport shares, and the handshake rule both ends apply.

Runs in: every worker that serves or opens a side channel (pull, push, SFA) and the schedulers
(`prompt_digest`). All are `core.wire.Message` Structs tagged on ``kind``; each transport's
``messages`` module adds its own messages and declares its `core.wire.Channel`:

| message | meaning | used by |
|---|---|---|
| `Greeting` (base) | a client's first request: its `Handshake` and engine id | `GetMeta`, SFA's ``Hello`` |
| `GetMeta` | "send me your KV metadata" | pull (D -> P), push (P -> D) |
| `MetaReply` | the server's handshake and `AgentMetadata` | pull, push |
| `Refused` | the handshake was refused; ``field`` names the first difference | all three |
| `Done` | the sender finished with a request, ``ok`` or not | pull (D -> P), push (P -> D) |
| `Ack` | acknowledges a notification | pull, push |

The server side of every handshake is `admit` (one rule: not our own engine id, then
`check_compatible`); the client side is `accept_reply` (a `Refused` becomes `IncompatiblePeer`
naming the field, the server's handshake is checked too when it sends one).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec
import numpy as np

from ascend_dist.common.errors import IncompatiblePeer, ProtocolError
from ascend_dist.common.wire import Handshake, check_compatible
from ascend_dist.kv_mooncake.core.wire import Message, Request

__all__ = [
    "Ack",
    "AgentMetadata",
    "Done",
    "GetMeta",
    "Greeting",
    "MetaReply",
    "Refused",
    "TensorMeta",
    "accept_reply",
    "admit",
    "prompt_digest",
]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


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
    """What a worker tells its peer about its KV cache (pull: P's, read by D; push: D's, written by P).

    Attributes:
        engine_id: The worker's engine id.
        te_session: Mooncake session id ``"<host>:<rpc_port>"``.
        tp_rank: The worker's tp rank.
        pp_rank: The worker's pp rank (always 0 on push's D).
        block_size: Tokens per logical block.
        num_blocks: Logical blocks per tensor.
        layers: Layer name -> its tensors (K, V or MLA parts) in order.
    """

    engine_id: str
    te_session: str
    tp_rank: int
    block_size: int
    num_blocks: int
    layers: dict[str, list[TensorMeta]]
    pp_rank: int = 0


class Greeting(Request, frozen=True, kw_only=True):
    """Base of a channel's opening request: the client's handshake and engine id (see `admit`)."""

    handshake: Handshake
    engine_id: str


class GetMeta(Greeting, frozen=True, kw_only=True, tag="get_meta"):
    """The client asks for the server's KV metadata, presenting its handshake."""


class MetaReply(Message, frozen=True, kw_only=True, tag="meta"):
    """The answer to `GetMeta`: the server's handshake and metadata."""

    handshake: Handshake
    metadata: AgentMetadata


class Refused(Message, frozen=True, kw_only=True, tag="refused"):
    """The server refused the client's greeting; ``field`` names the first difference."""

    field: str
    local: str
    remote: str


class Done(Request, frozen=True, kw_only=True, tag="done"):
    """The sender finished with ``request_id``: successfully (``ok``) or not (``reason``).

    Attributes:
        request_id: The request the server knows (pull: P's id; push: D's external id).
        ok: Whether the sender's part succeeded.
        reason: Why it failed (push's P tells D; empty when ``ok``).
        sender: Push: P's rank identity; D counts ``trans_count`` distinct senders.
        trans_count: Push: how many senders D waits for before the request is received.
        d_rank: Pull: the D rank that finished pulling (for P's logs).
    """

    request_id: str
    ok: bool = True
    reason: str = ""
    sender: str = ""
    trans_count: int = 1
    d_rank: int = 0


class Ack(Message, frozen=True, kw_only=True, tag="ack"):
    """Acknowledges a notification.

    Attributes:
        known: Pull: whether P still tracked the request(s) of a ``Renew`` or `Done`.
        unknown: Push: request ids D does not (or no longer) wait for.
    """

    known: bool = True
    unknown: list[str] = msgspec.field(default_factory=list)


def admit(
    local: Handshake, engine_id: str, greeting: Greeting, check: Callable[[], None] | None = None
) -> Refused | None:
    """The server's handshake rule: None to serve the client, or the `Refused` to answer with.

    Refused when the client claims our own engine id, when `check_compatible` finds a difference
    (protocol, `core.wire.WIRE_VERSION`, a compat field), or when ``check`` (a transport's
    extra checks, raising `IncompatiblePeer`) does. An authenticating deployment would verify the
    client's key here, before anything is served.
    """
    try:
        if greeting.engine_id == engine_id:
            raise IncompatiblePeer("engine_id", engine_id, greeting.engine_id)
        check_compatible(local, greeting.handshake)
        if check is not None:
            check()
    except IncompatiblePeer as exc:
        logger.error("refused %s: %s", greeting.handshake.sender or greeting.engine_id, exc)
        return Refused(field=exc.field, local=str(exc.local), remote=str(exc.remote))
    return None


def accept_reply(reply: Message, expected: type[M], local: Handshake, peer: str) -> M:
    """The client's side of the handshake: the server's answer to a `Greeting`, checked.

    Raises:
        IncompatiblePeer: The server refused us (``field`` as it named it; local and remote seen
            from this side), or the handshake in its reply differs from ours.
        ProtocolError: The reply is of another type than ``expected``.
    """
    if isinstance(reply, Refused):
        raise IncompatiblePeer(reply.field, reply.remote, reply.local)
    if not isinstance(reply, expected):
        raise ProtocolError(f"expected {expected.__name__} from {peer}, got {type(reply).__name__}")
    remote = getattr(reply, "handshake", None)
    if isinstance(remote, Handshake):
        check_compatible(local, remote)
    return reply


def prompt_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 (first 32 hex digits) of prompt token ids as little-endian int64.

    P puts it in its params; D pulls only when its own prompt has the same digest, so params
    replayed onto another prompt, or copied from another client's request, never read that KV.
    """
    return hashlib.sha256(np.asarray(token_ids, dtype="<i8").tobytes()).hexdigest()[:32]
