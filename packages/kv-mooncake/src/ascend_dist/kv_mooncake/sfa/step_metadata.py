"""What the SFA schedulers hand their workers each step (D's destinations, P's readable chunks).

Runs in: built by `sfa.scheduler` in the scheduler process, carried inside vLLM's connector
metadata, read by `sfa.consumer` and `sfa.producer` (which therefore need not import the scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ConsumerMetadata", "ProducerMetadata", "RecvReq", "SendReq"]


@dataclass(frozen=True)
class RecvReq:
    """D: where a request's blocks go (destinations, looked up by ``ext_id`` when P's reads arrive)."""

    request_id: str
    ext_id: str
    main_block_ids: tuple[int, ...]
    indexer_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ConsumerMetadata:
    """D's per-step metadata: newly allocated requests."""

    requests: tuple[RecvReq, ...] = ()


@dataclass(frozen=True)
class SendReq:
    """P: one request's chunk this step.

    Attributes:
        ext_id: D's id of the request.
        main_block_ids: P's main block ids of the whole request so far.
        indexer_block_ids: P's indexer block ids so far (empty: the indexer shares main's group).
        d_host: D's host.
        d_base_port: D's side-channel base (P adds its D rank).
        d_tp: D's TP size.
        cached_tokens: Tokens D already held.
        transferred_tokens: Tokens made readable by earlier chunks (block aligned).
        computed_tokens: Tokens computed once this step's forward finished.
        chunk_finish: This step completes the prompt.
        d_engine_id: D's engine id as its contact names it: P reads are offered only to a D
            endpoint that answers the hello as this engine (host and port are not signed).
    """

    ext_id: str
    main_block_ids: tuple[int, ...]
    indexer_block_ids: tuple[int, ...]
    d_host: str
    d_base_port: int
    d_tp: int
    cached_tokens: int
    transferred_tokens: int
    computed_tokens: int
    chunk_finish: bool
    d_engine_id: str = ""


@dataclass(frozen=True)
class ProducerMetadata:
    """P's per-step metadata: the chunks D may read once each layer is written."""

    requests: tuple[SendReq, ...] = ()
