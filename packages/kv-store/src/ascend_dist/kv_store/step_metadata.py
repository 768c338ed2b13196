"""What the scheduler hands the workers each step: per-request load specs and save ranges.

Runs in: the scheduler process (built by `scheduler.plan` / `scheduler.scheduler`) and every
worker (read by `transfer`). Pure frozen data, no I/O. Top-level so that `scheduler/` and
`transfer/` both import it and neither imports the other (moved out of `scheduler/plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadSpec", "PoolStepMeta", "ReqMeta"]


@dataclass(frozen=True)
class LoadSpec:
    """What a request loads from the pool.

    ``vllm_cached_tokens``: already in HBM; ``pool_cached_tokens``: valid after the load;
    ``store_skip_tokens``: the raw pool hit (not re-stored); ``can_load``: load this step.
    """

    vllm_cached_tokens: int
    pool_cached_tokens: int
    store_skip_tokens: int = 0
    can_load: bool = False

    def load_token_len(self, granularity: int, token_len_chunk: int) -> int:
        """Tokens the worker loads: the hit, or the whole last chunk when the hit was cut by one.

        When the scheduler reported ``hit - 1`` (a full hit must leave one token
        to compute) the worker still loads the whole chunk; the recomputed token overwrites it.
        """
        cached = self.pool_cached_tokens
        if cached % granularity and cached == token_len_chunk - 1:
            return cached + 1
        return cached


@dataclass(frozen=True)
class ReqMeta:
    """What one worker does for one request this step."""

    req_id: str
    save_start_token: int
    save_end_token: int
    target_token_len: int
    block_ids: tuple[tuple[int, ...], ...]
    block_hashes: tuple[bytes, ...]
    can_save: bool
    load_spec: LoadSpec | None
    is_last_chunk: bool
    num_prompt_tokens: int
    token_ids: tuple[int, ...] = ()  # only with KV events: the tokens of the saved range
    tail_hash: bytes | None = None  # the prompt's partial last chunk (``discard_partial_chunks=false``)


@dataclass(frozen=True)
class PoolStepMeta:
    """Everything the workers need for one step, built once by the scheduler and never mutated."""

    requests: tuple[ReqMeta, ...] = ()
    preempted_req_ids: frozenset[str] = frozenset()
    delayed_free_req_ids: frozenset[str] = frozenset()
