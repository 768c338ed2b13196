"""The envelope every kv-mooncake side-channel message shares: base Structs, tag, version, codecs.

Runs in: every process that speaks a kv-mooncake side channel (pull, push, SFA workers) and the
schedulers that build transfer params. Three rules hold for all three transports:

* **One tag.** Every message derives from `Message`: a msgspec Struct tagged on ``kind``, so a
  channel's requests (and its replies) form one tagged union and a frame names its own type.
* **One version.** `WIRE_VERSION` is the version of this whole vocabulary; `Channel.handshake`
  puts it, with the channel's name, into the `Handshake` the opening message carries, and
  `ascend_dist.common.wire.check_compatible` refuses a peer whose name, version or compat fields
  differ (the refusal names the field). Schema evolution follows `ascend_dist.common.wire`.
* **One codec factory.** `Channel.request_codec` / `reply_codec` decode strictly into the
  channel's union and refuse frames over the configured size before decoding them.

Frames are authenticated below this vocabulary, in the RPC envelope every channel shares
(`ascend_dist.common.frame_auth`: a MAC, timestamp and nonce per frame when a deployment secret is
set), so no message carries a MAC; `Request.auth` is kept, empty, for schema compatibility.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from ascend_dist.common.wire import Codec, CompatValue, Handshake, make_handshake

__all__ = ["WIRE_VERSION", "Channel", "Message", "Request"]

# 2: one tag field (``kind``) for pull and push too, and the shared Ack / Done / MetaReply shapes;
# a version-1 peer cannot decode these frames, so it is refused at the handshake.
# 3: every message bound to its channel (pull's ``pull_done``, push's ``push_done``), bounded fields,
# `Refused` without the server's value.
# 4: pull's `Renew` and `Done` carry the signed capability (`core.capability.Grant`) of each request
# (`Renew.grants`, `Done.grant`); a version-3 D could not present it, so it is refused at the handshake.
# 5: pull's side channel batched per P rank: `Renew` is answered by `Held` (one flag per request id,
# up to 64 ids) and D sends its DONEs as one `Dones` list; and a capability names the host of each
# P port (`Capability.hosts`, a P instance spanning nodes). A version-4 peer can decode neither.
WIRE_VERSION = 5


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    """Base of every side-channel message; subclasses set ``tag=`` to their wire name."""


class Request(Message, frozen=True, kw_only=True):
    """Base of every message a client sends (the server answers each with one reply).

    Attributes:
        auth: Unused and empty. Peers are authenticated per frame by the RPC envelope
            (`ascend_dist.common.frame_auth`), which covers every request and reply whole; the
            field stays (schema rule 2: never removed) so older peers still decode.
    """

    auth: bytes = b""


@dataclass(frozen=True)
class Channel:
    """One side channel's name and its request and reply unions.

    Attributes:
        name: The channel, carried in every handshake, e.g. ``"kv-mooncake/pull"``.
        requests: The union of `Request` subclasses a client may send.
        replies: The union of `Message` subclasses a server may answer with.
    """

    name: str
    requests: Any
    replies: Any

    def handshake(self, *, sender: str, **fields: CompatValue) -> Handshake:
        """This side's handshake on the channel: its name, `WIRE_VERSION` and the compat fields."""
        return make_handshake(self.name, WIRE_VERSION, sender=sender, **fields)

    def request_codec(self, max_bytes: int) -> Codec[Any]:
        """Codec of client -> server messages (strict, frames over ``max_bytes`` refused).

        A frame it cannot decode raises `ProtocolError` whose ``reply`` is a `Refused` naming the
        field (``protocol_version`` for a peer of another `WIRE_VERSION`): the server answers with
        it instead of an error frame, so a peer of another version is told why.
        """
        from ascend_dist.kv_mooncake.core.messages import refuse_frame  # messages build on this module

        replies = Codec(self.replies, max_bytes=max_bytes)
        return Codec(self.requests, max_bytes=max_bytes, refuse=refuse_frame(self.name, replies.encode))

    def reply_codec(self, max_bytes: int) -> Codec[Any]:
        """Codec of server -> client replies (strict, frames over ``max_bytes`` refused)."""
        return Codec(self.replies, max_bytes=max_bytes)
