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
from ascend_dist.common.transfer_stats import TransferStats
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.backends.gva import GvaBackend
from ascend_dist.kv_store.config.config import PoolConfig
from ascend_dist.kv_store.config.sizes import DerivedSizes
from ascend_dist.kv_store.keys.coordinator import GroupRule, HybridCoordinator
from ascend_dist.kv_store.keys.keys import (
    KeyMetadata,
    RankLayout,
    normalize_model_name,
    put_step_and_head,
    rank_position,
    write_shard,
)
from ascend_dist.kv_store.keys.rekey import KeySplit
from ascend_dist.kv_store.keys.token_db import ChunkedTokenDatabase
from ascend_dist.kv_store.keys.tp_mismatch import TpMismatchInfo
from ascend_dist.kv_store.lookup.pool_lookup import PoolLookup
from ascend_dist.kv_store.scheduler.plan import MambaGroups
from ascend_dist.kv_store.scheduler.scheduler import KVPoolScheduler, LookupFn
from ascend_dist.kv_store.transfer.chunk_plan import ChunkPlanner
from ascend_dist.kv_store.transfer.events import EventCollector
from ascend_dist.kv_store.transfer.failures import LoadErrorRecorder
from ascend_dist.kv_store.transfer.gva_layerwise import make_layer_transfers
from ascend_dist.kv_store.transfer.strategy import (
    LayerwiseStrategy,
    SaveGuard,
    TransferStrategy,
    WholeRequestSaves,
    WholeRequestTransfers,
)
from ascend_dist.kv_store.transfer.whole_request import WholeRequestIO
from ascend_dist.kv_store.transfer.worker import KVPoolWorker
from ascend_dist.kv_store.transfer.worker_types import ComputeEvent, WorkerStats, WorkerWaits

__all__ = ["PoolSpec", "WorkerWaits", "build_scheduler", "build_worker"]


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
        """Ranks sharing identical KV (the same key variant), which split the writes."""
        return self.write_shard()[1]

    def write_shard(self) -> tuple[int, int]:
        """``(shard_rank, shard_size)`` of this rank among the ranks writing the same keys (`write_shard`).

        Raises:
            ConfigError: ``dcp_rank`` is not the one vLLM gives this TP/PCP position.
        """
        sizes = {"tp_size": self.tp_size, "pp_size": self.pp_size, "pcp_size": self.pcp_size, "dcp_size": self.dcp_size}
        rank = (self.pp_rank * self.pcp_size + self.pcp_rank) * self.tp_size + self.tp_rank
        if rank_position(rank, **sizes).dcp_rank != self.dcp_rank:
            raise ConfigError("dcp_rank", self.dcp_rank, f"{rank_position(rank, **sizes).dcp_rank} at this TP/PCP rank")
        return write_shard(rank, **sizes, num_kv_heads=self.num_kv_heads, use_mla=self.use_mla)

    def write_rank(self) -> int:
        """The rank the worker shards writes by (it keeps chunks ``i % put_step == write_rank % put_step``).

        ``tp_rank`` itself without DCP; with DCP the shard index, as DCP peers of one TP replica
        set hold different tokens and must not split one key variant's writes by TP rank.
        """
        shard, size = self.write_shard()
        return self.tp_rank if self.tp_rank % size == shard else shard

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
    waits: WorkerWaits | None = None,
    transfer_stats: TransferStats | None = None,
) -> KVPoolWorker:
    """The worker side of ``spec`` over ``backend``, with its transfer strategy chosen here, once.

    Args:
        spec: The instance's KV layout.
        config: The pool settings (load mode, layer-wise options, saving role, KV events).
        backend: The store client.
        record_compute_event: Records an event on the compute stream after the forward pass (device
            runtimes); the sending thread waits for it before reading the KV cache. None on CPU.
        waits: Deadlines of the worker's waits (defaults: `WorkerWaits`).
        transfer_stats: Where every store call is recorded (the connector's recorder, channel
            ``pool``, which vLLM empties at every step); None: store calls are not recorded.

    Raises:
        ConfigError: Layer-wise mode for a model with several KV-cache groups, or with memcache
            under PP or context parallelism; a TP/PP key split with layer-wise or hybrid models.
    """
    waits = waits or WorkerWaits()
    token_db, coordinator, split = spec.token_db(), spec.coordinator(), spec.key_split()
    granularity, layout, put_step = spec.sizes().granularity, spec.rank_layout(), spec.put_step()
    layerwise = config.use_layerwise
    if split is not None and split.active and (layerwise or token_db.num_groups != 1):
        raise ConfigError("prefill_tp_size/prefill_pp_size", split, "no TP/PP key split with layer-wise or hybrid")
    if layerwise and token_db.num_groups != 1:
        raise ConfigError("use_layerwise", True, "false for models with several KV-cache groups")
    if layerwise and isinstance(backend, GvaBackend) and layout.pp_size * layout.pcp_size * layout.dcp_size > 1:
        raise ConfigError("use_layerwise", True, "false with memcache under PP or context parallelism")
    errors, events, stats = LoadErrorRecorder(), EventCollector(), WorkerStats(transfer=transfer_stats)
    sparse = coordinator is not None and coordinator.is_sparse
    guard = SaveGuard(preempt_wait_s=waits.preempt_s, fence_wait_s=waits.fence_s, retry_failed_puts=not sparse)
    planner = ChunkPlanner(
        token_db,
        granularity=granularity,
        tp_rank=spec.write_rank(),
        put_step=put_step,
        coordinator=coordinator,
        split=split,
    )
    transfers = _transfers(spec, config, backend, record_compute_event, waits, token_db=token_db, planner=planner,
                           guard=guard, errors=errors, events=events, stats=stats, sparse=sparse)  # fmt: skip
    stages = spec.stage_layers

    def stage_layers() -> tuple[int, ...]:  # rank-0 layer-wise lookups check every stage's layer keys
        return stages or (transfers.num_layers,) * layout.pp_size

    lookup = PoolLookup(
        token_db=token_db, backend=backend, layout=layout, granularity=granularity, coordinator=coordinator,
        stage_layers=stage_layers if layerwise else None, gva=layerwise and isinstance(backend, GvaBackend),
    )  # fmt: skip
    return KVPoolWorker(
        token_db=token_db, backend=backend, lookup=lookup, transfers=transfers, guard=guard, errors=errors,
        events=events, stats=stats, key_split=split,
    )  # fmt: skip


def _transfers(
    spec: PoolSpec,
    config: PoolConfig,
    backend: PoolBackend,
    record_compute_event: Callable[[], ComputeEvent] | None,
    waits: WorkerWaits,
    *,
    token_db: ChunkedTokenDatabase,
    planner: ChunkPlanner,
    guard: SaveGuard,
    errors: LoadErrorRecorder,
    events: EventCollector,
    stats: WorkerStats,
    sparse: bool,
) -> TransferStrategy:
    """The one transfer strategy of this worker (see `strategy`)."""
    if config.use_layerwise:
        layers = make_layer_transfers(
            config.layerwise_options(spec.tp_size),
            token_db=token_db, backend=backend, errors=errors, stats=stats, saves=guard.saves,
            granularity=spec.sizes().granularity, tp_rank=spec.write_rank(), put_step=spec.put_step(),
            can_save=config.can_save, record_compute_event=record_compute_event, compute_wait_s=waits.compute_s,
            layer_wait_s=waits.step_load_s, fence=guard.fence, fence_wait_s=waits.fence_s,
            failed_puts=guard.failed_layer_puts,
            on_stored=(lambda chunks: events.add(planner.stored_events(chunks))) if config.kv_events else None,
        )  # fmt: skip
        return LayerwiseStrategy(layers, guard)
    io = WholeRequestIO(
        plan=planner, backend=backend, stats=stats, errors=errors, events=events if config.kv_events else None
    )
    saves = (
        WholeRequestSaves(
            io=io,
            backend=backend,
            guard=guard,
            stats=stats,
            tp_rank=spec.write_rank(),
            record_compute_event=record_compute_event,
            compute_wait_s=waits.compute_s,
            sync_saves=sparse,
        )
        if config.can_save
        else None
    )
    return WholeRequestTransfers(
        io=io, guard=guard, errors=errors, saves=saves, load_async=config.load_async, tp_rank=spec.write_rank()
    )


def build_scheduler(spec: PoolSpec, config: PoolConfig, lookup: LookupFn) -> KVPoolScheduler:
    """The scheduler side of ``spec`` asking ``lookup``."""
    mamba = frozenset(g for g, kind in enumerate(spec.group_kinds) if kind == "mamba")
    groups = MambaGroups(mamba, spec.sizes().grouped_block_sizes, spec.mamba_spec_blocks) if mamba else None
    return KVPoolScheduler(
        config, spec.sizes(), spec.namespace(), lookup, mamba=groups, retention_interval=spec.retention_interval
    )
