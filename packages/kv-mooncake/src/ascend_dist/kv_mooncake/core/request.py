"""The request as every transport's scheduler side sees it: plain values, no vLLM objects.

The vLLM adapters build a `SchedRequest` from vLLM's `Request`; planning and scheduler modules of
pull, push and SFA work on it, so none of them needs another transport's scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SchedRequest"]


@dataclass
class SchedRequest:
    """What the scheduler hooks read from a request.

    Attributes:
        request_id: The engine's request id.
        prompt_len: Prompt tokens.
        kv_transfer_params: The request's params dict (mutated in place, as vLLM does).
        length_capped: The request finished because it hit ``max_tokens`` (P's normal end).
        prompt_digest: `messages.prompt_digest` of the prompt (P sends it; None: prompt embeddings).
    """

    request_id: str
    prompt_len: int
    kv_transfer_params: dict[str, Any] | None
    length_capped: bool = False
    prompt_digest: str | None = None
