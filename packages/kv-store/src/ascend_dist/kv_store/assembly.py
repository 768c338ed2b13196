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

from ascend_dist.common.hashing import stable_hash
from ascend_dist.kv_store.backends.base import PoolBackend
from ascend_dist.kv_store.config import PoolConfig
from ascend_dist.kv_store.keys import KeyMetadata, RankLayout, normalize_model_name, put_step_and_head
from ascend_dist.kv_store.scheduler import KVPoolScheduler, LookupFn
from ascend_dist.kv_store.sizes import DerivedSizes
from ascend_dist.kv_store.token_db import ChunkedTokenDatabase
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
            self.tp_size,
            self.pp_size,
            self.pcp_size,
            self.dcp_size,
            int(self.use_mla),
            self.num_kv_heads,
            self.layout_tag,
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
            tp_size=self.tp_size,
            pp_size=self.pp_size,
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
    )


def build_scheduler(spec: PoolSpec, config: PoolConfig, lookup: LookupFn) -> KVPoolScheduler:
    """The scheduler side of ``spec`` asking ``lookup``."""
    return KVPoolScheduler(config, spec.sizes(), spec.namespace(), lookup)
