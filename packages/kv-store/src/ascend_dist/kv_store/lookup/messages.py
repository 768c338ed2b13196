"""Wire protocol of the lookup RPC (scheduler -> rank-0 worker).

Runs in: the scheduler and the rank-0 worker of each data-parallel engine. Changing a Struct here is
a protocol change: bump `PROTOCOL_VERSION`. Every request carries a compatibility hash of the key
scheme (model name, block sizes, parallel layout): a worker with a different scheme answers with an
error and zero hits instead of answering about keys the scheduler never meant (no false hits).

Every field is range-checked by the decoder (counts non-negative and bounded, hashes of a hash's
size, at most `MAX_GROUPS` groups), so a hostile frame is refused before the worker allocates
anything for it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ascend_dist.common.wire import Codec

__all__ = ["MAX_GROUPS", "MAX_TOKENS", "PROTOCOL_VERSION", "LookupCodec", "LookupReply", "LookupRequest", "ReplyCodec"]

PROTOCOL_VERSION = 2  # 2: tail_hash (partial last chunks)

MAX_TOKENS = 2**31 - 1
"""Largest token count accepted (a bound, not a limit of any model)."""
MAX_GROUPS = 256
"""Most KV-cache groups a lookup may name."""
_MAX_HASH_BYTES = 64

Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
GroupId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_GROUPS)]
Hash = Annotated[bytes, msgspec.Meta(max_length=_MAX_HASH_BYTES)]


class LookupRequest(msgspec.Struct, frozen=True, kw_only=True, tag="lookup", tag_field="kind"):
    """How many leading tokens of this prompt does the pool hold?

    ``block_hashes`` are the request's fine prefix hashes (32-byte digests), ``token_len`` the
    granularity-floored prompt length to look up (the whole prompt when partial chunks are pooled),
    ``hbm_hit_tokens`` what vLLM already holds, ``tail_hash`` the hash of the partial last chunk.
    """

    protocol_version: int = PROTOCOL_VERSION
    compat_hash: Annotated[str, msgspec.Meta(max_length=128)]
    token_len: Tokens
    group_ids: Annotated[tuple[GroupId, ...], msgspec.Meta(min_length=1, max_length=MAX_GROUPS)] = (0,)
    hbm_hit_tokens: Tokens = 0
    block_hashes: tuple[Hash, ...] = ()
    tail_hash: Hash = b""  # the prompt's partial last chunk (only with discard_partial_chunks=false)


class LookupReply(msgspec.Struct, frozen=True, kw_only=True, tag="hits", tag_field="kind"):
    """The hit length in tokens; ``error`` says why it is 0 when the lookup was refused."""

    protocol_version: int = PROTOCOL_VERSION
    hit_tokens: int
    error: str = ""


LookupCodec: Codec[LookupRequest] = Codec(LookupRequest, max_bytes=64 << 20)
ReplyCodec: Codec[LookupReply] = Codec(LookupReply, max_bytes=4096)
