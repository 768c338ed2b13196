"""What the layer-wise scheduler hands its workers each step.

Runs in: built by `push.scheduler` in the scheduler process, carried inside vLLM's connector
metadata, read by `push.worker`, `push.producer` and `push.receiver` (which therefore need not import
the scheduler).
"""

from __future__ import annotations

import msgspec

from ascend_dist.kv_mooncake.push.messages import PushParams

__all__ = ["LayerwiseMetadata", "RecvReqMeta", "SendReqMeta"]


class RecvReqMeta(msgspec.Struct, frozen=True, kw_only=True):
    """D: wait for a request's layers (or fail it now, when ``failed`` says why)."""

    request_id: str
    transfer_id: str
    block_ids: list[list[int]]
    failed: str = ""


class SendReqMeta(msgspec.Struct, frozen=True, kw_only=True):
    """P: push this step's computed blocks of a request into D's blocks."""

    request_id: str
    params: PushParams
    local_block_ids: list[list[int]]
    prompt_len: int
    transed_tokens: int
    computed_tokens: int
    chunk_finished: bool


class LayerwiseMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """One step's work for the workers."""

    recv: list[RecvReqMeta] = []
    send: list[SendReqMeta] = []
    ended: list[str] = []  # P: transfer ids of requests that ended before their last chunk (abort, stop)
