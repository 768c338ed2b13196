"""Wire protocol of the lookup RPC (scheduler -> rank-0 worker).

Runs in: the scheduler and the rank-0 worker of each data-parallel engine. Changing a Struct here is
a protocol change: bump `PROTOCOL_VERSION`. Every request carries a compatibility hash of the key
scheme (model name, block sizes, parallel layout): a worker with a different scheme answers with an
error and zero hits instead of answering about keys the scheduler never meant (no false hits).
"""

from __future__ import annotations

import msgspec

from ascend_dist.common.wire import Codec

__all__ = ["PROTOCOL_VERSION", "LookupCodec", "LookupReply", "LookupRequest", "ReplyCodec"]

PROTOCOL_VERSION = 2  # 2: tail_hash (partial last chunks)


class LookupRequest(msgspec.Struct, frozen=True, kw_only=True, tag="lookup", tag_field="kind"):
    """How many leading tokens of this prompt does the pool hold?

    ``block_hashes`` are the request's fine prefix hashes (32-byte digests), ``token_len`` the
    granularity-floored prompt length to look up (the whole prompt when partial chunks are pooled),
    ``hbm_hit_tokens`` what vLLM already holds, ``tail_hash`` the hash of the partial last chunk.
    """

    protocol_version: int = PROTOCOL_VERSION
    compat_hash: str
    token_len: int
    group_ids: tuple[int, ...] = (0,)
    hbm_hit_tokens: int = 0
    block_hashes: tuple[bytes, ...] = ()
    tail_hash: bytes = b""  # the prompt's partial last chunk (only with discard_partial_chunks=false)


class LookupReply(msgspec.Struct, frozen=True, kw_only=True, tag="hits", tag_field="kind"):
    """The hit length in tokens; ``error`` says why it is 0 when the lookup was refused."""

    protocol_version: int = PROTOCOL_VERSION
    hit_tokens: int
    error: str = ""


LookupCodec: Codec[LookupRequest] = Codec(LookupRequest, max_bytes=64 << 20)
ReplyCodec: Codec[LookupReply] = Codec(LookupReply, max_bytes=4096)
