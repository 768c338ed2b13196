"""The messages every kv-mooncake transport shares, and the handshake rule both ends apply.

Runs in: every worker that serves or opens a side channel (pull, push, SFA) and the schedulers
(`prompt_digest`). All are `core.wire.Message` Structs tagged on ``kind``; each transport's
``messages`` module adds its own messages and declares its `core.wire.Channel`:

| message | meaning | used by |
|---|---|---|
| `Greeting` (base) | a client's first request: its `Handshake` and engine id | `GetMeta`, SFA's ``Hello`` |
| `GetMeta` | "send me your KV metadata" | pull (D -> P), push (P -> D) |
| `MetaReply` | the server's handshake and `AgentMetadata` | pull, push |
| `Refused` | the handshake (or a frame) was refused; ``field`` names what differs | all three |
| `Done` | pull's D finished with a request, ``ok`` or not (push has its own `PushDone`) | pull (D -> P) |
| `Ack` | acknowledges a notification | pull, push |

Every message type belongs to one channel: pull's `Done` and push's ``PushDone`` have their own
tags, so a frame of one channel never decodes on another (`GetMeta` is bound by the channel name in
its handshake).

The server side of every handshake is `admit` (one rule: not our own engine id, then
`check_compatible`); the client side is `accept_reply` (a `Refused` becomes `IncompatiblePeer`
naming the field, the server's handshake is checked too when it sends one). A refusal names the
field that differs and never the server's own value (that would hand a prober the server's setup
one field per try). A frame the server cannot decode at all is answered by `refuse_frame`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import msgspec
import numpy as np

from ascend_dist.common.errors import IncompatiblePeer, ProtocolError
from ascend_dist.common.wire import Handshake, check_compatible
from ascend_dist.kv_mooncake.core.capability import Grant
from ascend_dist.kv_mooncake.core.wire import WIRE_VERSION, Message, Request

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
    "refuse_frame",
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


MAX_TRANSPORT_PORTS = 8
"""Listener ports a worker may name in `AgentMetadata.transport_ports` (Mooncake's TCP transport opens one)."""


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
        transport_ports: Where the worker's Mooncake transport listens besides ``te_session``'s
            port (pull's P: a D that gives up a read cuts its connections to them; empty from a
            peer that does not say, which leaves D without that cut).
        incarnation: A random token of the worker process's life (`tcp_sockets.process_incarnation`):
            a P restarted on the same ports (and so the same ``te_session``) sends another, so D
            knows its pooled connections there are dead (empty from a peer that does not say).
            Push's D: a token of the worker's registration (a new worker draws another, in the same
            process too), named again in each answer to a ``Claim``.
    """

    engine_id: str
    te_session: str
    tp_rank: int
    block_size: int
    num_blocks: int
    layers: dict[str, list[TensorMeta]]
    pp_rank: int = 0
    transport_ports: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1, le=65535)], ...], msgspec.Meta(max_length=MAX_TRANSPORT_PORTS)
    ] = ()
    incarnation: Annotated[str, msgspec.Meta(max_length=64)] = ""

    @property
    def owner(self) -> str:
        """Who serves ``transport_ports`` now: the session and the life of the worker's process."""
        return f"{self.te_session}#{self.incarnation}" if self.incarnation else self.te_session


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


MAX_WIRE_TEXT = 256
"""Longest id or name accepted in a side-channel message."""
MAX_RANK = 65535
"""Largest rank number accepted in a side-channel message."""

WireText = Annotated[str, msgspec.Meta(max_length=MAX_WIRE_TEXT)]
"""A request id, sender or engine id on the wire (bounded before anything is allocated for it)."""
Rank = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANK)]
"""A rank number on the wire."""


class Refused(Message, frozen=True, kw_only=True, tag="refused"):
    """The server refused the client's greeting (or a frame); ``field`` names what differs.

    Attributes:
        field: The first field that differs (``protocol_version``, ``dtype``, ...), or for a frame
            that could not be decoded the part of it that was wrong (``kind``, ``$.request_id``).
        local: Always empty: the server never discloses its own value (kept for wire compatibility).
        remote: The client's own value as the server read it (nothing the client did not send).
    """

    field: str
    local: str = ""
    remote: str = ""


class Done(Request, frozen=True, kw_only=True, tag="pull_done"):
    """Pull: D finished with ``request_id``, successfully (``ok``) or not.

    Its tag is pull's own: push's P sends `push.messages.PushDone`, so neither decodes on the
    other channel's server.

    Attributes:
        request_id: P's id of the request.
        ok: Whether D's pull succeeded.
        d_rank: The D rank that finished pulling.
        sender: The D task beside ``d_rank`` (CP rank and shard): P counts each ``(d_rank, sender)``
            once, so a copy the RPC client resent never frees blocks another D task still reads.
        grant: With a deployment secret, the capability P signed for ``request_id``
            (`core.capability`): P counts no DONE it did not sign for, so nobody else frees them.
        reader: The token of the D pull that sent it (`pull.messages.Renew.readers`): P counts a
            DONE only from the reader its ``(d_rank, sender)`` is bound to ("" is a reader too).
    """

    request_id: WireText
    ok: bool
    d_rank: Rank
    sender: WireText = ""
    grant: Grant | None = None
    reader: WireText = ""


class Ack(Message, frozen=True, kw_only=True, tag="ack"):
    """Acknowledges a notification.

    Attributes:
        known: Pull, answer to ``Renew``: whether P still holds the renewed request (the caller's
            own question). An Ack to `Done` leaves it at its default whatever P knew, so DONEs
            cannot be used to ask which request ids P holds.
        unknown: Push: request ids D does not (or no longer) wait for, among those the message named.
        incarnation: Push, answer to ``Claim``: the answering D worker's `AgentMetadata.incarnation`
            (P compares it with the metadata it writes with; empty from a D that does not say).
    """

    known: bool = True
    unknown: list[str] = msgspec.field(default_factory=list)
    incarnation: Annotated[str, msgspec.Meta(max_length=64)] = ""


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
        logger.error("refused %s: %s", greeting.handshake.sender[:MAX_WIRE_TEXT] or greeting.engine_id, exc)
        return Refused(field=exc.field, remote=str(exc.remote)[:MAX_WIRE_TEXT])
    return None


def _peer_version(payload: bytes) -> object:
    """The ``handshake.protocol_version`` a frame claims, if it is a map that has one (else None)."""
    try:
        raw: Any = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError):
        return None
    if not isinstance(raw, dict):
        return None
    shake = raw.get("handshake")
    return shake.get("protocol_version") if isinstance(shake, dict) else None


def refuse_frame(channel: str, encode: Callable[[Message], bytes]) -> Callable[[ProtocolError, bytes], bytes | None]:
    """A request codec's ``refuse`` hook: answer an undecodable frame with a `Refused` naming the field.

    A peer of another `WIRE_VERSION` (its handshake says so) is told ``protocol_version``; any other
    frame is told ``message`` with msgspec's path of the bad part (``$.kind``: a message type this
    channel does not have). The answer carries only what the peer sent (its version), never ours.
    """

    def refuse(exc: ProtocolError, payload: bytes) -> bytes | None:
        version = _peer_version(payload) if payload else None
        if version is not None and version != WIRE_VERSION:
            return encode(Refused(field="protocol_version", remote=str(version)[:MAX_WIRE_TEXT]))
        cause = exc.__cause__
        detail = str(cause) if isinstance(cause, msgspec.ValidationError) else type(cause or exc).__name__
        at = detail.rsplit(" - at `", 1)
        field = at[1].rstrip("`") if len(at) == 2 else "message"
        logger.debug("refused a %s frame: %s", channel, detail)
        return encode(Refused(field=field[:MAX_WIRE_TEXT]))

    return refuse


def accept_reply(reply: Message, expected: type[M], local: Handshake, peer: str) -> M:
    """The client's side of the handshake: the server's answer to a `Greeting`, checked.

    Raises:
        IncompatiblePeer: The server refused us (``field`` as it named it; local and remote seen
            from this side), or the handshake in its reply differs from ours.
        ProtocolError: The reply is of another type than ``expected``.
    """
    if isinstance(reply, Refused):
        raise IncompatiblePeer(reply.field, reply.remote or "(ours)", "(not disclosed)")
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
