"""The pool lookup on the rank-0 worker: how many leading prompt tokens every rank can load.

Runs in: the rank-0 worker (served to the scheduler by the lookup RPC).

A chunk counts only when the keys of every rank holding distinct data exist (TP heads, PP stages,
PCP and DCP ranks; in layer-wise mode every layer of every stage too). Chunks inside the HBM hit
are taken as present without asking the store (upstream re-queried them). Models whose
groups are all full attention use the plain prefix rule; hybrid models (sliding window, Mamba) and
EAGLE go through `HybridCoordinator`, which asks only for the chunks an aligned hit could read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from ascend_dist.common.errors import StoreError
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.backends.gva import GvaBackend
from ascend_dist.kv_store.config.sizes import floor_to
from ascend_dist.kv_store.keys.coordinator import HybridCoordinator
from ascend_dist.kv_store.keys.keys import RankLayout, gva_block_key
from ascend_dist.kv_store.keys.token_db import ChunkedTokenDatabase

PROBE_MIN_KEYS: Final = 256
"""Ask for the first chunk alone before the rest only from this many keys: one store round trip
costs ~0.1 ms here, about as much as asking ~250 more keys in the same call."""

__all__ = ["PoolLookup"]


class PoolLookup:
    """Builds the all-rank keys of a prompt's chunks, asks the store once per group, applies the hit rules."""

    def __init__(
        self,
        *,
        token_db: ChunkedTokenDatabase,
        layout: RankLayout,
        backend: PoolBackend,
        granularity: int,
        coordinator: HybridCoordinator | None = None,
        stage_layers: Callable[[], Sequence[int]] | None = None,
        gva: bool = False,
    ) -> None:
        """Create the lookup.

        Args:
            token_db: This rank's key database.
            layout: The parallel layout (which key variants exist).
            backend: The store client.
            granularity: Transfer granularity in tokens.
            coordinator: Hybrid/EAGLE hit rules (None: plain prefix rule per group).
            stage_layers: Layer-wise mode: layers per PP stage (None: whole-chunk keys).
            gva: GVA layer-wise mode: one object per block under its GVA key (one per TP head),
                present when published (`GvaBackend.key_info` size > 0).
        """
        self._db = token_db
        self._layout = layout
        self._backend = backend
        self._granularity = granularity
        self._coordinator = coordinator
        self._stage_layers = stage_layers
        self._gva = backend if gva and isinstance(backend, GvaBackend) else None

    def _keys(self, group: int, hashes: Sequence[bytes | str]) -> list[str]:
        meta = self._db.metadata[group]
        if self._gva is not None:
            heads = range(self._layout.group_tp_size(group))
            return [gva_block_key(meta.model_name, h, head) for head in heads for h in hashes]
        if self._stage_layers is None:
            return self._layout.expand(meta, hashes)
        stages = tuple(self._stage_layers())
        if not stages or min(stages) < 1:
            raise StoreError("layer-wise lookup before the KV caches were registered")
        return self._layout.expand_layers(meta, hashes, stages)

    def _present(
        self, group: int, hashes: Sequence[bytes], n: int, known: int, mask: Sequence[bool] | None
    ) -> list[bool]:
        """Per chunk of ``group``: present for every rank (chunks below ``known`` are in HBM)."""
        grouped = self._db.grouped_hashes(hashes, group)
        ask = [i for i in range(known, n) if mask is None or mask[i]]
        present = [i < known for i in range(n)]
        if not ask:
            return present
        variants = self._variants(group)
        if mask is None and len(ask) > 1 and len(ask) * variants >= PROBE_MIN_KEYS:
            # Prefix rule: the first missing chunk ends the hit, so ask for the first chunk alone
            # first. A miss then costs one key per rank instead of one per chunk and rank; a hit
            # costs one more round trip, which only pays off for long prompts.
            first = self._exists(self._keys(group, [grouped[ask[0]]]))
            if not all(c == 1 for c in first):
                return present
            present[ask[0]] = True
            ask = ask[1:]
        codes = self._exists(self._keys(group, [grouped[i] for i in ask]))
        width = len(ask)
        # codes hold one row of `width` flags per rank variant; a chunk is present when every row has it
        rows = [codes[v : v + width] for v in range(0, len(codes), width)]
        for i, flags in zip(ask, zip(*rows, strict=True), strict=True):
            present[i] = min(flags) == 1
        return present

    def _exists(self, keys: list[str]) -> list[int]:
        if self._gva is None:
            return self._backend.exists(keys)
        return [1 if size > 0 else 0 for size, _ in self._gva.key_info(keys)]

    def _variants(self, group: int) -> int:
        if self._gva is not None:
            return self._layout.group_tp_size(group)
        variants = self._layout.num_variants(group)
        if self._stage_layers is None:
            return variants
        return variants * max(self._stage_layers(), default=1)

    def lookup(
        self,
        token_len: int,
        hashes: Sequence[bytes],
        group_ids: Sequence[int] = (0,),
        hbm_hit_tokens: int = 0,
        tail_hash: bytes = b"",
    ) -> int:
        """Leading tokens of the prompt held by the pool for every rank and group.

        ``tail_hash`` (one group, ``token_len`` not a whole number of chunks): the prompt's partial
        last chunk also counts when every whole chunk before it and its own object are present.

        Raises:
            StoreError: The store cannot be asked (callers turn it into 0 hits).
        """
        coord = self._coordinator
        if coord is not None and list(group_ids) == list(range(self._db.num_groups)):
            aligned = floor_to(token_len, coord.align)
            present: list[list[bool]] = []
            for g in group_ids:
                span = self._db.block_sizes[g]
                n = min(len(self._db.grouped_hashes(hashes, g)), aligned // span)
                known = min(hbm_hit_tokens // span, n)
                present.append(self._present(g, hashes, n, known, coord.lookup_mask(g, n)))
            return coord.longest_hit(present, aligned)
        if tail_hash and list(group_ids) == [0] and token_len % self._db.block_sizes[0]:
            return self._with_tail(token_len, hashes, hbm_hit_tokens, tail_hash)
        # Prefix rule: a group serves every multiple of the granularity up to the end of its leading
        # run of present chunks, so the common hit is the smallest such end.
        hit = floor_to(token_len, self._granularity)
        for g in group_ids:
            span = self._db.block_sizes[g]
            n = min(len(self._db.grouped_hashes(hashes, g)), token_len // span)
            if n == 0:
                return 0
            known = min(floor_to(hbm_hit_tokens, span) // span, n)
            flags = self._present(g, hashes, n, known, None)
            run = flags.index(False) if False in flags else n
            hit = min(hit, floor_to(run * span, self._granularity))
        return hit

    def _with_tail(self, token_len: int, hashes: Sequence[bytes], hbm_hit_tokens: int, tail: bytes) -> int:
        span = self._db.block_sizes[0]
        whole = floor_to(token_len, span)
        hit = self.lookup(whole, hashes, (0,), hbm_hit_tokens) if whole else 0
        if hit != whole or self._stage_layers is not None:
            return hit
        suffix = f"@partial:{token_len - whole}"
        codes = self._exists([k + suffix for k in self._layout.expand(self._db.metadata[0], [tail])])
        return token_len if all(c == 1 for c in codes) else hit
