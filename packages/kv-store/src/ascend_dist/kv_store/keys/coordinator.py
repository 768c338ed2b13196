"""Hybrid-model coordinator: which pool chunks each KV group needs, and the longest common hit.

Runs in: the rank-0 worker (lookups) and every worker (store and load masks). Pure planning, no
vLLM import: the per-group hit rules of vLLM's single-type KV-cache managers are re-implemented
here behind `GroupRule` (full attention, sliding window, Mamba), over a present/absent flag per
chunk instead of vLLM's block pool.

* **full attention**: a hit is the run of present chunks from chunk 0.
* **sliding window** (window ``W``, chunk span ``B``): only the last ``k = cdiv(W - 1, B)`` chunks
  before the hit end are read, so a hit ending at ``e`` needs those ``k`` chunks only (a run that
  starts at chunk 0 may be shorter). Chunks before them are neither looked up nor loaded, and only
  chunks some aligned hit could read are stored (the reachability mask).
* **Mamba** (``align`` mode): a hit ending at ``e`` needs only the state chunk ending at ``e``.
* **EAGLE** (speculative decoding with a draft model): the last matched chunk is dropped, because
  the draft model needs its hidden states recomputed; a sliding-window hit therefore needs one more
  contiguous chunk (vLLM's rule).

Several groups: start from the prompt's aligned length and let each group lower the candidate hit
(every hit a multiple of the alignment, the transfer granularity) until no group lowers it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError, format_allowed
from ascend_dist.kv_store.config.sizes import cdiv, floor_to

__all__ = ["KINDS", "GroupRule", "HybridCoordinator"]

KINDS = ("full", "sliding_window", "mamba")


@dataclass(frozen=True)
class GroupRule:
    """How one KV group reads cached chunks."""

    kind: str
    block_size: int  # chunk span of the group, in tokens
    window: int = 0  # sliding window in tokens (sliding_window only)

    def __post_init__(self) -> None:
        """Validate the kind and sizes."""
        if self.kind not in KINDS:
            raise ConfigError("group kind", self.kind, format_allowed(KINDS))
        if self.block_size < 1 or (self.kind == "sliding_window" and self.window < 1):
            raise ConfigError("group sizes", (self.block_size, self.window), "a positive block size (and window)")

    def contiguous(self, use_eagle: bool) -> int:
        """Chunks a sliding-window hit needs before its end (vLLM ``_contiguous_blocks_for_hit``)."""
        return cdiv(self.window - 1, self.block_size) + (1 if use_eagle else 0)

    def hit(self, present: Sequence[bool], max_length: int, align: int, use_eagle: bool = False) -> int:
        """Longest hit (tokens, a multiple of ``align``, at most ``max_length``) this group can serve.

        Examples (B=128, align 512, 8 chunks): full attention, all present -> 1024; sliding window
        256 with chunks ``[2, 3, 6, 7]`` present -> 1024, and with chunk 7 missing -> 512.
        """
        b = self.block_size
        n = min(len(present), max_length // b)
        if self.kind == "full":
            run = 0
            while run < n and present[run]:
                run += 1
            if use_eagle and run:
                run -= 1
            return floor_to(run * b, align)
        if self.kind == "mamba":
            for i in range(n - 1, -1, -1):
                if present[i] and ((i + 1) * b) % align == 0:
                    return (i + 1) * b
            return 0
        need = self.contiguous(use_eagle)
        run = 0
        for i in range(n - 1, -1, -1):
            if not present[i]:
                run = 0
                continue
            if run == 0 and ((i if use_eagle else i + 1) * b) % align:
                continue  # a run must end on an aligned boundary
            run += 1
            if run >= need or i == 0:  # enough chunks, or the run reaches the prompt start
                end = i + run - (1 if use_eagle else 0)
                return floor_to(end * b, align)
        return 0

    def reachable(
        self,
        num_chunks: int,
        align: int,
        use_eagle: bool = False,
        *,
        retention: int | None = None,
        prompt_end: int | None = None,
    ) -> list[bool] | None:
        """Chunks some aligned hit could read (stored and looked up); None = every chunk.

        ``retention`` (vLLM's ``prefix_cache_retention_interval``, tokens; None = dense): a sliding
        window keeps its tail once per ``retention`` tokens, a Mamba group one state per
        ``retention`` tokens (0: only the boundaries below), plus, for storing, the tail ending at
        the prompt's replay boundary (``prompt_end - 1`` aligned down) and the prompt's final segment.
        Example (B=16, window 33 -> 2 chunks, retention 64 = 4 chunks, 12 chunks): chunks 2, 3, 6, 7,
        10, 11.
        """
        b = self.block_size
        if self.kind == "full" or align % b:
            return None
        if retention is not None:
            return self._sparse(num_chunks, align, use_eagle, retention, prompt_end)
        mask = [False] * num_chunks
        shift = 1 if use_eagle else 0
        for end in range(align // b, num_chunks + 1, align // b):  # chunk index one past each boundary
            if self.kind == "mamba":
                mask[end - 1] = True
                continue
            last = min(end - 1 + shift, num_chunks - 1)
            for i in range(max(0, last - self.contiguous(use_eagle) + 1), last + 1):
                mask[i] = True
        return mask

    def _sparse(
        self, num_chunks: int, align: int, use_eagle: bool, retention: int, prompt_end: int | None
    ) -> list[bool] | None:
        """`reachable` under a retention interval (vLLM's ``reachable_block_mask`` rules)."""
        per = retention // self.block_size
        if self.kind == "mamba":
            if per == 1:
                return self.reachable(num_chunks, align, use_eagle)  # every aligned boundary is one
            return self._sparse_states(num_chunks, align, per, prompt_end)
        need, shift = self.contiguous(use_eagle), (1 if use_eagle else 0)
        if per and need >= per:
            return None  # every chunk is some segment's tail
        mask = [False] * num_chunks
        for i in range(shift, num_chunks) if per else ():
            if (i - shift) % per >= per - need:
                mask[i] = True
        if prompt_end:
            final = prompt_end // self.block_size  # the prompt's last segment keeps its tail too
            if per and final % per and not use_eagle:
                for i in range(max(final - final % per, final - need), min(num_chunks, final)):
                    mask[i] = True
            end = floor_to(prompt_end - 1, align) // self.block_size + shift  # the replay boundary
            for i in range(max(0, end - need), min(num_chunks, end)):
                mask[i] = True
        return mask

    def _sparse_states(self, num_chunks: int, align: int, per: int, prompt_end: int | None) -> list[bool]:
        mask = [False] * num_chunks
        for i in range(per - 1, num_chunks, per) if per else ():
            mask[i] = True
        if prompt_end:
            end = floor_to(prompt_end - 1, align) // self.block_size  # the replay boundary's state
            if 0 < end <= num_chunks:
                mask[end - 1] = True
        return mask

    def needed_for_hit(self, hit: int) -> tuple[int, int]:
        """Chunk range ``[first, end)`` a hit of ``hit`` tokens reads (what a load must fill)."""
        end = hit // self.block_size
        if self.kind == "full":
            return 0, end
        if self.kind == "mamba":
            return max(0, end - 1), end
        return max(0, end - self.contiguous(False)), end


class HybridCoordinator:
    """The longest prefix every group can serve, and per-group store/load masks."""

    def __init__(
        self, rules: Sequence[GroupRule], align: int, *, use_eagle: bool = False, retention: int | None = None
    ) -> None:
        """Create the coordinator.

        Args:
            rules: One rule per KV group, in group order.
            align: Transfer granularity (every group's span divides it).
            use_eagle: Speculative decoding with an EAGLE draft model (drops the last matched chunk).
            retention: vLLM's ``prefix_cache_retention_interval`` (tokens, a multiple of ``align``):
                sliding-window and Mamba chunks are stored once per interval; None = every reachable one.

        Raises:
            ConfigError: A group's chunk span does not divide ``align``, or ``retention`` is not a
                non-negative multiple of it.
        """
        bad = [r.block_size for r in rules if align % r.block_size]
        if bad or not rules:
            raise ConfigError(
                "granularity", align, f"a multiple of every group's chunk span {[r.block_size for r in rules]}"
            )
        if retention is not None and (retention < 0 or retention % align):
            raise ConfigError("prefix_cache_retention_interval", retention, f"a non-negative multiple of {align}")
        self.rules = tuple(rules)
        self.align = align
        self.use_eagle = use_eagle
        self.retention = retention

    @property
    def is_sparse(self) -> bool:
        """Whether any group reads less than every chunk (otherwise plain prefix rules apply)."""
        return any(r.kind != "full" for r in self.rules)

    def longest_hit(self, present: Sequence[Sequence[bool]], max_length: int) -> int:
        """The largest aligned hit every group serves (fix-point over the groups).

        Args:
            present: Per group, a flag per chunk (chunk present for every rank).
            max_length: Upper bound (the prompt's aligned length).
        """
        hit = floor_to(max_length, self.align)
        while hit > 0:
            lowest = min(self._group_hit(rule, p, hit) for rule, p in zip(self.rules, present, strict=True))
            if lowest == hit:
                break
            hit = lowest
        return max(hit, 0)

    def _group_hit(self, rule: GroupRule, present: Sequence[bool], hit: int) -> int:
        # EAGLE drops the last matched chunk: look one chunk past the candidate so that a stable
        # hit is not lowered again every round (Mamba groups have no EAGLE shift).
        peek = rule.block_size if self.use_eagle and rule.kind != "mamba" else 0
        return min(hit, rule.hit(present, hit + peek, self.align, self.use_eagle))

    def store_mask(self, group: int, num_chunks: int, prompt_len: int | None = None) -> list[bool] | None:
        """Chunks of ``group`` worth storing (None = all), sparse under a retention interval."""
        return self.rules[group].reachable(
            num_chunks, self.align, self.use_eagle, retention=self.retention, prompt_end=prompt_len
        )

    def lookup_mask(self, group: int, num_chunks: int) -> list[bool] | None:
        """Chunks of ``group`` a lookup asks for (None = all): every chunk an aligned hit could read."""
        return self.rules[group].reachable(num_chunks, self.align, self.use_eagle)

    def load_range(self, group: int, hit: int) -> tuple[int, int]:
        """Chunk range of ``group`` a load of ``hit`` tokens fills."""
        return self.rules[group].needed_for_hit(hit)
