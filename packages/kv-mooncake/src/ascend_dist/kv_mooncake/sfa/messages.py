"""The SFA remote-D2H connector's wire: P greets and signals, D reads and answers.

Runs in: P workers (client side, a DEALER per D endpoint), D workers (the ROUTER read thread),
schedulers (the contact info D posts to the metaserver). Built on the shared vocabulary of
`ascend_dist.kv_mooncake.core.messages` (tag ``kind``, `core.wire.WIRE_VERSION`):

* `Hello` (a `Greeting`: P's `Handshake` and engine id, plus its engine session and per-layer
  metadata; upstream MF_META) is answered by `HelloAck` or `Refused`.
* `ReadReady` (one layer: per request P's block ids and chunk start; upstream READ_READY_BATCH)
  is answered by `ReadDone` (naming requests D could not serve) or `ReadFailed`.
* `Commit` (P's verdict on the requests whose last layer it dispatched: the ones to count as
  received and the ones P gave up on) is answered by `Committed`. Only P's clock decides whether a
  read came in time: a `ReadDone` that reaches P after its deadline has no effect, so D counts a
  request received only on P's `Commit` (upstream counts it at D's last read, so a read that
  outlasted P's reuse gate was reported as loaded).

D remembers a `Hello` per ``sender`` (upstream: per DEALER identity); a `ReadReady` from a sender
without one fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from ascend_dist.kv_mooncake.core.admission import Count, ParallelSize, Port, Text, check_host, convert_params
from ascend_dist.kv_mooncake.core.capability import Tag, WallMs
from ascend_dist.kv_mooncake.core.messages import MAX_TRANSPORT_PORTS, Greeting, Refused
from ascend_dist.kv_mooncake.core.wire import Channel, Message
from ascend_dist.kv_mooncake.core.wire import Request as _Request

__all__ = [
    "CHANNEL",
    "Commit",
    "Committed",
    "ContactInfo",
    "Hello",
    "HelloAck",
    "LayerMeta",
    "ReadDone",
    "ReadFailed",
    "ReadReady",
    "ReadReq",
    "Reply",
    "Request",
    "TensorSpan",
    "parse_contact",
    "reply_codec",
    "request_codec",
]


class TensorSpan(msgspec.Struct, frozen=True, array_like=True):
    """One registered tensor of a layer: ``[base address, bytes per logical block]``."""

    base: int
    block_bytes: int


class LayerMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What P tells D about one transformer layer's caches (upstream's MF_META entry).

    Attributes:
        layer_idx: Transformer layer index (parsed from ``layers.<i>``).
        main: The main (MLA) tensors: two on Ascend (nope, rope), one in vLLM's own MLA layout.
        indexer: The indexer tensors of the same layer (k, optionally its scale); may be empty.
    """

    layer_idx: int
    main: list[TensorSpan]
    indexer: list[TensorSpan] = []


class Hello(Greeting, frozen=True, kw_only=True, tag="hello"):
    """P's first message to a D endpoint: compatibility (the `Greeting`), session and layer metadata.

    ``incarnation`` (a token of P's process life) and ``transport_ports`` (where P's Mooncake
    transport listens besides the session's port) let D tell a P restarted on a dead P's session
    apart (`core.session_owners`); empty from a P that does not say.
    """

    sender: str
    session: str
    layers: dict[str, LayerMeta]
    incarnation: Annotated[str, msgspec.Meta(max_length=64)] = ""
    transport_ports: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=1, le=65535)], ...], msgspec.Meta(max_length=MAX_TRANSPORT_PORTS)
    ] = ()

    @property
    def owner(self) -> str:
        """Who serves ``transport_ports``: the session and the life of P's process."""
        return f"{self.session}#{self.incarnation}" if self.incarnation else self.session


class ReadReq(msgspec.Struct, frozen=True, array_like=True):
    """One request's part of a layer: ``[ext id, P main ids, P indexer ids, main start, indexer start]``.

    ``p_main_ids[i]`` holds the request's block number ``main_start + i`` (the same for indexer).
    """

    ext_id: str
    p_main_ids: list[int]
    p_indexer_ids: list[int]
    main_start: int = 0
    indexer_start: int = 0


class ReadReady(_Request, frozen=True, kw_only=True, tag="read_ready"):
    """P wrote ``layer_name`` for these requests' chunks: D may read them now.

    ``done_ext_ids`` end their last chunk with this layer (P's `Commit` for them follows D's
    answer). ``read_budget_ms``: how long after receiving this D may still start a read attempt
    (a duration, so no clocks are compared across hosts; 0 = no limit). It only spares D reads P
    will not accept: whether a read counts is P's verdict in its `Commit`.
    """

    sender: str
    layer_idx: int
    layer_name: str
    reads: list[ReadReq]
    done_ext_ids: list[str] = msgspec.field(default_factory=list)
    group_member_idx: int = 0
    tp_ratio: int = 1
    read_budget_ms: int = 0


class Commit(_Request, frozen=True, kw_only=True, tag="commit"):
    """P's verdict after its last layer's reads for these requests were answered in time.

    ``ext_ids``: every one of this sender's reads for them was answered by D before P's deadline:
    count this contributor (``group_member_idx`` of ``tp_ratio``). ``failed_ext_ids``: P gave up
    on a read of theirs (deadline, endpoint down, D's failure): fail them now.
    """

    sender: str
    ext_ids: list[str] = msgspec.field(default_factory=list)
    failed_ext_ids: list[str] = msgspec.field(default_factory=list)
    group_member_idx: int = 0
    tp_ratio: int = 1


class HelloAck(Message, frozen=True, kw_only=True, tag="hello_ack"):
    """D accepted P's hello."""

    receiver: str = ""


class ReadDone(Message, frozen=True, kw_only=True, tag="read_done"):
    """D finished the layer's reads; ``failed`` lists requests it could not serve."""

    layer_idx: int
    failed: list[str] = msgspec.field(default_factory=list)


class Committed(Message, frozen=True, kw_only=True, tag="committed"):
    """D took P's verdict; ``failed`` lists committed requests D had already failed or never had."""

    failed: list[str] = msgspec.field(default_factory=list)


class ReadFailed(Message, frozen=True, kw_only=True, tag="read_failed"):
    """The whole layer batch failed (every request in it is failed on D)."""

    layer_idx: int
    error: str


Request = Hello | ReadReady | Commit
Reply = HelloAck | Refused | ReadDone | ReadFailed | Committed

CHANNEL = Channel("kv-mooncake/sfa-rd2h", Request, Reply)
request_codec, reply_codec = CHANNEL.request_codec, CHANNEL.reply_codec  # P -> D; D -> P


class ContactInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """``kv_transfer_params`` D posts to the metaserver for P: contact only, no block ids.

    Attributes:
        request_id: D's external request id (P sends it back in every `ReadReq`).
        remote_engine_id: D's engine id.
        remote_host: D's side-channel host.
        remote_port: D's base port for its DP rank (``kv_port + dp_rank * D_tp``).
        remote_tp_size: D's TP size.
        remote_cached_tokens: Prompt tokens D already holds (P starts after them).
        remote_capability: With a deployment secret, D's signature (hex) over ``request_id``,
            ``remote_engine_id`` and ``remote_capability_expires`` (`core.capability`, no block ids:
            P never names D's blocks); P sends reads only for a contact D signed.
        remote_capability_expires: Wall-clock ms after which P refuses the contact.
    """

    request_id: Text
    remote_engine_id: Text
    remote_host: Text
    remote_port: Port
    remote_tp_size: ParallelSize
    remote_cached_tokens: Count = 0
    do_remote_prefill: bool = False
    do_remote_decode: bool = True
    remote_pcp_size: ParallelSize = 1
    remote_dcp_size: ParallelSize = 1
    remote_capability: Tag | None = None
    remote_capability_expires: WallMs | None = None


def parse_contact(raw: Mapping[str, Any]) -> ContactInfo:
    """Validate D's contact info as P's scheduler receives it in ``kv_transfer_params``.

    Types, ranges and lengths are bounded (the params come from the proxy's clients); flags must be
    booleans.

    Raises:
        ConfigError: A key is missing or has the wrong type or range; the error names
            ``kv_transfer_params.<key>``.
    """
    info = convert_params(raw, ContactInfo)
    check_host("remote_host", info.remote_host)
    return info
