"""Scheduler-side planning: request trackers, building per-step request metadata, hit helpers.

Runs in: the scheduler process (the hit helpers also on the rank-0 worker). Pure: no I/O.

Matched tokens (scheduler), per-request worker metadata and the hit helpers. Deliberate
differences from upstream:

* a running request is re-examined every step, not only when it got new blocks, so the chunk
  completed by a step that allocated no block (the prompt tail) is still saved;
* partial chunks are saved under their own ``@partial:N`` key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_store.config.sizes import cdiv, floor_to
from ascend_dist.kv_store.step_metadata import LoadSpec, ReqMeta

__all__ = [
    "MambaGroups",
    "RequestTracker",
    "build_req_meta",
    "common_hit",
    "continuous_hits",
    "discontinuous_hits",
    "mamba_update",
    "matched_tokens",
]


def matched_tokens(
    hit: int, num_computed: int, num_tokens: int, *, load_async: bool
) -> tuple[int, bool, LoadSpec | None]:
    """Turn a pool hit into vLLM's ``(tokens_to_load, is_async)``.

    Examples (64-token prompt): hit 48, computed 16 -> ``(32, False)``; hit 64, computed 0 ->
    ``(63, False)`` with ``store_skip=64``; hit 16, computed 32 -> ``(0, False)``, no spec.

    Returns:
        ``(need, is_async, load_spec)``; the spec is None when nothing is loaded.
    """
    if hit <= 0:
        return 0, False, None
    store_skip = hit
    if hit == num_tokens:
        hit -= 1
    need = max(hit - num_computed, 0)
    if need <= 0:
        return 0, False, None
    return need, load_async, LoadSpec(num_computed, hit, store_skip, False)


@dataclass
class RequestTracker:
    """Scheduler-side progress of one request across steps."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[list[int]]
    hashes: list[bytes] = field(default_factory=list)
    num_saved_tokens: int = 0
    tail: bytes | None = None  # hash of the prompt's partial last chunk (partial chunks pooled)

    @property
    def token_len(self) -> int:
        """Tokens computed once this step's forward ran."""
        return len(self.token_ids)

    def update(
        self,
        new_token_ids: Sequence[int],
        new_block_ids: Sequence[Sequence[int]] | None,
        *,
        mamba: MambaGroups | None = None,
        num_computed: int = 0,
    ) -> None:
        """Append this step's tokens and blocks (per group); Mamba groups drop stale state blocks.

        Raises:
            ConfigError: ``new_block_ids`` is not a per-group sequence.
        """
        self.token_ids.extend(new_token_ids)
        if new_block_ids is None:
            return
        if not isinstance(new_block_ids, list | tuple):
            raise ConfigError("new_block_ids", type(new_block_ids).__name__, "a list or tuple of per-group lists")
        while len(self.block_ids) < len(new_block_ids):
            self.block_ids.append([])
        for g, ids in enumerate(new_block_ids):
            if mamba is not None and g in mamba.groups:
                self.block_ids[g] = mamba_update(
                    self.block_ids[g], ids, num_computed=num_computed,
                    spec_blocks=mamba.spec_blocks, block_size=mamba.block_sizes[g],
                )  # fmt: skip
            else:
                self.block_ids[g].extend(ids)


@dataclass(frozen=True)
class MambaGroups:
    """Which KV groups are Mamba ``align`` groups, their block sizes and speculative blocks."""

    groups: frozenset[int]
    block_sizes: tuple[int, ...]
    spec_blocks: int = 0


def mamba_update(
    existing: Sequence[int], new: Sequence[int], *, num_computed: int, spec_blocks: int, block_size: int
) -> list[int]:
    """A Mamba group's block ids after a step: stale state blocks become null (0).

    vLLM keeps only the state blocks still needed (the latest ones and the speculative ones) and
    frees the others; zeroing them here means a save never reads a block vLLM already reused.
    Examples (B=16, s=3): ``[0,3,4,5,6]`` + new ``[4,17]`` at 32 computed -> ``[0,3,0,5,6,4,17]``;
    ``[0]*7+[9,10,11,12]`` + ``[0,0,0,0,10,11,12,29]`` at 128 -> ``[0]*7+[9]+[0]*7+[10,11,12,29]``.
    """
    out = list(existing)
    lead = min(len(out), max(num_computed - spec_blocks - 1, 0) // block_size)
    out[:lead] = [0] * lead
    if new and spec_blocks > 0 and out:
        m = min(len(new) - 1, spec_blocks)
        if m >= spec_blocks:
            out[-spec_blocks:] = [0] * min(spec_blocks, len(out))
        else:
            start, stop = len(out) - spec_blocks, len(out) - spec_blocks + m
            for i in range(max(start, 0), max(stop, 0)):
                out[i] = 0
    out.extend(new)
    return out


def build_req_meta(
    tracker: RequestTracker,
    granularity: int,
    *,
    hash_block_size: int,
    load_spec: LoadSpec | None = None,
    skip_save: bool = False,
    discard_partial: bool = True,
    is_last_chunk: bool = False,
    with_token_ids: bool = False,
    save_limit: int | None = None,
) -> ReqMeta | None:
    """Decide what to save (and load) for ``tracker`` this step; None when there is nothing to do.

    Examples (G=16): T=32, S0=0, 2 hashes -> save ``[0, 32)``; T=20 discarding -> save to 16;
    T=20 not discarding, 20-token prompt with a tail hash -> to 20 (the partial tail is saved only
    at the prompt's end, the only partial chunk a lookup asks for); T=32, S0=32 -> None.
    ``save_limit`` caps the save's end (T=48, limit 16 -> to 16): blocks from there on hold no chunk yet.

    Raises:
        ConfigError: ``granularity`` is not a multiple of ``hash_block_size``.
    """
    if granularity % hash_block_size:
        raise ConfigError("granularity", granularity, f"a multiple of hash_block_size={hash_block_size}")
    total, saved = tracker.token_len, tracker.num_saved_tokens
    # Never save past the hashes we have: a chunk without its hash cannot be keyed.
    to_save = min(floor_to(total, granularity), floor_to(len(tracker.hashes) * hash_block_size, granularity))
    boundary = cdiv(saved + 1, granularity) * granularity
    at_prompt_end = total == tracker.num_prompt_tokens and to_save == floor_to(total, granularity)
    if not discard_partial and tracker.tail is not None and total % granularity and at_prompt_end:
        to_save, boundary = total, saved + 1  # the prompt's partial tail, under its own key and hash
    if save_limit is not None and to_save > save_limit:  # a block from there on holds no chunk yet
        to_save = floor_to(save_limit, granularity)
    skip = skip_save or to_save < boundary
    if skip and load_spec is None:
        return None
    if not skip:
        tracker.num_saved_tokens = max(saved, to_save)
    return ReqMeta(
        req_id=tracker.req_id,
        save_start_token=saved,
        save_end_token=to_save,
        target_token_len=total,
        block_ids=tuple(tuple(ids) for ids in tracker.block_ids),
        block_hashes=tuple(tracker.hashes),
        can_save=not skip,
        load_spec=load_spec if load_spec is not None and load_spec.can_load else None,
        is_last_chunk=is_last_chunk,
        num_prompt_tokens=tracker.num_prompt_tokens or total,
        token_ids=tuple(tracker.token_ids[:to_save]) if with_token_ids and not skip else (),
        tail_hash=tracker.tail if not discard_partial else None,
    )


def continuous_hits(ends: Sequence[int], present: Sequence[Sequence[int]], granularity: int, max_hit: int) -> list[int]:
    """Hit end positions of a regular group: stop at the first chunk missing on any rank.

    Example (G=16, ends 16/32/48): ranks ``[1,1,0]`` and ``[1,0,1]`` -> ``[16]``.
    """
    out: list[int] = []
    for i, end in enumerate(ends):
        if end > max_hit or not all(row[i] == 1 for row in present):
            break
        if end % granularity == 0:
            out.append(end)
    return out


def discontinuous_hits(
    ends: Sequence[int], present: Sequence[Sequence[int]], granularity: int, max_hit: int
) -> list[int]:
    """Hit end positions of an align-state (Mamba) group: missing chunks do not stop the walk.

    Example: ends 16..96, both ranks ``[0,0,1,0,0,1]`` -> ``[48, 96]`` (max 64 -> ``[48]``).
    """
    out: list[int] = []
    for i, end in enumerate(ends):
        if end > max_hit:
            break
        if all(row[i] == 1 for row in present) and end % granularity == 0:
            out.append(end)
    return out


def common_hit(groups: Sequence[Sequence[int]]) -> int:
    """The largest position every group can serve; 0 if none (``[[16,32,48],[32,48],[16,32]]`` -> 32)."""
    if not groups or any(not g for g in groups):
        return 0
    common = set(groups[0]).intersection(*map(set, groups[1:]))
    return max(common, default=0)
