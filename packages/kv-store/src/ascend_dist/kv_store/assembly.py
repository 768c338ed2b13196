"""Builds the scheduler and worker sides from one description of the instance (`PoolSpec`).

Runs in: scheduler and worker processes (the vLLM adapter, the demo, tests). Pure wiring.

Both roles derive the same sizes, key metadata, hash namespace and compatibility hash from the
same `PoolSpec`, which is what keeps scheduler lookups and worker keys in agreement (the "most
fragile invariant", upstream issue #9168). The hash namespace holds everything that changes the
bytes behind a key (model name, block sizes, parallel layout, MLA, KV heads), so instances that
differ in any of them never share a prefix hash and cannot produce false hits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.hashing import stable_hash
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.config import PoolConfig
from ascend_dist.kv_store.coordinator import GroupRule, HybridCoordinator
from ascend_dist.kv_store.keys import KeyMetadata, RankLayout, normalize_model_name, put_step_and_head
from ascend_dist.kv_store.plan import MambaGroups
from ascend_dist.kv_store.rekey import KeySplit
from ascend_dist.kv_store.scheduler import KVPoolScheduler, LookupFn
from ascend_dist.kv_store.sizes import DerivedSizes
from ascend_dist.kv_store.token_db import ChunkedTokenDatabase
from ascend_dist.kv_store.tp_mismatch import TpMismatchInfo
from ascend_dist.kv_store.worker import ComputeEvent, KVPoolWorker

__all__ = ["PoolSpec", "build_scheduler", "build_worker"]


@dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """What identifies one instance's KV layout for the pool."""

    model: str
    block_sizes: tuple[int, ...]
    num_kv_heads: int
    use_mla: bool = False
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    pcp_size: int = 1
    pcp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    dp_rank: int = 0
    prefix_match_unit: int | None = None
    cache_families: tuple[str, ...] = ()
    layout_tag: str = ""
    stage_layers: tuple[int, ...] = ()  # layers per PP stage (layer-wise lookups); () = equal stages
    group_kinds: tuple[str, ...] = ()  # per group: "full", "sliding_window", "mamba"; () = all full
    sliding_windows: tuple[int, ...] = ()  # per group: window in tokens (sliding_window groups)
    use_eagle: bool = False  # speculative decoding with an EAGLE draft model
    mamba_spec_blocks: int = 0  # speculative state blocks of Mamba groups (vLLM num_speculative_blocks)
    retention_interval: int | None = None  # vLLM prefix_cache_retention_interval: sparse SWA/Mamba saves
    peer_tp_size: int = 0  # the other P/D side's TP (TP-mismatch sub-keys); 0 = same as tp_size
    rekey_pp_parts: tuple[int, ...] = ()  # a decode instance keys chunks for a PP prefill with these stages

    def tp_info(self) -> TpMismatchInfo:
        """TP-mismatch facts (enabled only for GQA single-group models whose heads divide both TPs)."""
        return TpMismatchInfo.compute(
            local_tp=self.tp_size,
            peer_tp=self.peer_tp_size or None,
            num_kv_heads=self.num_kv_heads,
            use_mla=self.use_mla,
            use_hybrid=len(self.block_sizes) > 1,
        )

    @property
    def key_tp_size(self) -> int:
        """The TP size the pool's keys are laid out for (the larger one under a TP mismatch)."""
        info = self.tp_info()
        return info.effective_tp if info.enabled else self.tp_size

    @property
    def key_pp_parts(self) -> tuple[int, ...]:
        """Layers per PP stage of the pool's keys (() for one stage)."""
        if len(self.rekey_pp_parts) > 1:
            return self.rekey_pp_parts
        return self.stage_layers if self.pp_size > 1 else ()

    def key_split(self) -> KeySplit | None:
        """How this rank's chunks become pool keys when its layout differs from the pool's."""
        info = self.tp_info()
        split = KeySplit(self.tp_rank, info.num_sub_keys, self.rekey_pp_parts if len(self.rekey_pp_parts) > 1 else ())
        return split if split.active else None

    def coordinator(self) -> HybridCoordinator | None:
        """Hit/mask rules for hybrid models and EAGLE; None for plain prefix caching.

        Raises:
            ConfigError: ``group_kinds`` does not name one kind per group, or a window is missing.
        """
        if not self.group_kinds and not self.use_eagle:
            return None
        kinds = self.group_kinds or ("full",) * len(self.block_sizes)
        if len(kinds) != len(self.block_sizes):
            raise ConfigError("group_kinds", list(kinds), f"one kind per KV group ({len(self.block_sizes)})")
        sizes = self.sizes()
        rules = [
            GroupRule(kind, span, self.sliding_windows[g] if g < len(self.sliding_windows) else 0)
            for g, (kind, span) in enumerate(zip(kinds, sizes.grouped_block_sizes, strict=True))
        ]
        return HybridCoordinator(rules, sizes.granularity, use_eagle=self.use_eagle, retention=self.retention_interval)

    @property
    def model_name(self) -> str:
        """The normalised model name used in keys."""
        return normalize_model_name(self.model)

    def sizes(self) -> DerivedSizes:
        """Derived block sizes and granularity."""
        return DerivedSizes.compute(
            self.block_sizes, pcp_size=self.pcp_size, dcp_size=self.dcp_size, prefix_match_unit=self.prefix_match_unit
        )

    def namespace(self) -> tuple[str | int, ...]:
        """The hash-chain namespace: everything that changes the bytes behind a key."""
        return (
            self.model_name,
            *self.block_sizes,
            self.key_tp_size,
            len(self.key_pp_parts) or self.pp_size,
            *self.key_pp_parts,
            self.pcp_size,
            self.dcp_size,
            int(self.use_mla),
            self.num_kv_heads,
            self.layout_tag,
            *((",".join(self.group_kinds), *self.sliding_windows) if self.group_kinds else ()),
        )

    def compat_hash(self) -> str:
        """Checked on every lookup RPC: scheduler and worker must agree on the key scheme."""
        return stable_hash("ascend_dist.kv_store.compat", *self.namespace())

    def put_step(self) -> int:
        """Ranks sharing identical KV."""
        return put_step_and_head(self.tp_size, self.tp_rank, self.num_kv_heads, self.use_mla)[0]

    def key_metadata(self) -> list[KeyMetadata]:
        """This rank's key metadata per KV group."""
        head = put_step_and_head(self.tp_size, self.tp_rank, self.num_kv_heads, self.use_mla)[1]
        return [
            KeyMetadata(
                model_name=self.model_name,
                head_or_tp_rank=head,
                pcp_rank=self.pcp_rank,
                dcp_rank=self.dcp_rank,
                pp_rank=self.pp_rank,
                kv_cache_group_id=g,
                cache_family=self.cache_families[g] if g < len(self.cache_families) else "default",
            )
            for g in range(len(self.block_sizes))
        ]

    def rank_layout(self) -> RankLayout:
        """The layout used to expand lookup keys to every rank."""
        return RankLayout(
            tp_size=self.key_tp_size,
            pp_size=len(self.key_pp_parts) or self.pp_size,
            pcp_size=self.pcp_size,
            dcp_size=self.dcp_size,
            num_kv_heads=self.num_kv_heads,
            use_mla=self.use_mla,
        )

    def token_db(self) -> ChunkedTokenDatabase:
        """A fresh token database for this rank."""
        sizes = self.sizes()
        return ChunkedTokenDatabase(self.key_metadata(), sizes.grouped_block_sizes, sizes.hash_block_size)


def build_worker(
    spec: PoolSpec,
    config: PoolConfig,
    backend: PoolBackend,
    *,
    record_compute_event: Callable[[], ComputeEvent] | None = None,
) -> KVPoolWorker:
    """The worker side of ``spec`` over ``backend`` (see `KVPoolWorker` for ``record_compute_event``)."""
    return KVPoolWorker(
        record_compute_event=record_compute_event,
        kv_events=config.kv_events,
        token_db=spec.token_db(),
        layout=spec.rank_layout(),
        backend=backend,
        granularity=spec.sizes().granularity,
        tp_rank=spec.tp_rank,
        put_step=spec.put_step(),
        load_async=config.load_async,
        can_save=config.can_save,
        layerwise=config.use_layerwise,
        layerwise_options=config.layerwise_options(spec.tp_size),
        stage_layers=spec.stage_layers,
        coordinator=spec.coordinator(),
        key_split=spec.key_split(),
    )


def build_scheduler(spec: PoolSpec, config: PoolConfig, lookup: LookupFn) -> KVPoolScheduler:
    """The scheduler side of ``spec`` asking ``lookup``."""
    mamba = frozenset(g for g, kind in enumerate(spec.group_kinds) if kind == "mamba")
    groups = MambaGroups(mamba, spec.sizes().grouped_block_sizes, spec.mamba_spec_blocks) if mamba else None
    return KVPoolScheduler(
        config, spec.sizes(), spec.namespace(), lookup, mamba=groups, retention_interval=spec.retention_interval
    )
