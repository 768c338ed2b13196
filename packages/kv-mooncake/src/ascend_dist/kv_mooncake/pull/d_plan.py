"""What D reads for each request: one pull task per P rank (and PP stage, or CP shard) and its descriptors.

Runs in: D worker processes (called by `ascend_dist.kv_mooncake.pull.threads.Receiver`; no state
beyond its configuration, so any thread may call it). `PullPlanner.plan` turns a request's step
metadata into its `DRequest` record: without context parallelism one task per P rank it reads
from (`pull.sources`: heads, state groups) and per PP stage; with it one task per (P CP rank,
P rank) of each shard (`pull.cp_plan`) and, for state groups, tasks reading P's PCP rank 0.
`PullPlanner.task_descriptors` builds one task's descriptors for every KV group once P's metadata is
known (`pull.task_batch`). A CP layout this D cannot pull is refused when the planner is built
(at registration), not per request.
"""

from __future__ import annotations

import enum

from ascend_dist.kv_mooncake.core.mappings import context_parallel_parameters_check
from ascend_dist.kv_mooncake.core.messages import AgentMetadata
from ascend_dist.kv_mooncake.core.ranks import select_sources
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.cp_plan import cp_layouts, cp_sources, plan_cp_pull
from ascend_dist.kv_mooncake.pull.d_requests import DRequest, PullTask
from ascend_dist.kv_mooncake.pull.sources import pull_source_ranks, state_source_ranks
from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta
from ascend_dist.kv_mooncake.pull.task_batch import LocalCache, TaskBatch, check_peer_rank, task_batch

__all__ = ["PullPlanner", "ShardKind"]


class ShardKind(enum.IntEnum):
    """A pull task's ``shard`` when it is not a CP shard index (those are >= 0)."""

    WHOLE = -1
    """No context parallelism: the task reads every group D wants from one P rank (and PP stage)."""
    STATE_ONLY = -2
    """Context parallelism: the task reads only the state groups (replicated: from P's PCP rank 0)."""


class PullPlanner:
    """Plans D's pull tasks for one D rank (TP rank, PCP rank) over its cache."""

    def __init__(self, config: PullConfig, tp_rank: int, cache: LocalCache, *, pcp_rank: int, use_mla: bool) -> None:
        """Refuse a CP layout this rank cannot pull (`ConfigError`), before any request."""
        if config.uses_cp:
            p_info, d_info = cp_layouts(config, use_mla)
            context_parallel_parameters_check(p_info, d_info, cache.heads)
            cp_sources(tp_rank, p_info, d_info, cache.heads)
        self._config = config
        self._tp_rank = tp_rank
        self._cache = cache
        self._pcp_rank = pcp_rank
        self._use_mla = use_mla

    def plan(self, meta: ReqMeta, now: float) -> DRequest:
        """The request's record: its tasks, its head slices or CP shards, its deadline from ``now``."""
        return self._plan_cp(meta, now) if self._config.uses_cp else self._plan_whole(meta, now)

    def _plan_whole(self, meta: ReqMeta, now: float) -> DRequest:
        """Plan without context parallelism: one task per P rank (and PP stage) read."""
        p_tp, p_pp = meta.remote_ptp_size, self._config.prefill.pp_size
        slices = select_sources(
            self._tp_rank, p_tp, self._config.decode.tp_size, self._cache.heads, meta.remote_request_id
        )
        ranks = pull_source_ranks(
            self._tp_rank,
            p_tp,
            self._config.decode.tp_size,
            self._cache.heads,
            meta.remote_request_id,
            attention=bool(self._cache.attention_groups),
            state=self._cache.has_state,
        )
        tasks = [PullTask(stage * p_tp + p, ShardKind.WHOLE) for stage in range(p_pp) for p in ranks]
        return DRequest(meta, now + self._config.pull_timeout_s, pending=len(tasks), slices=slices, tasks=tasks)

    def _plan_cp(self, meta: ReqMeta, now: float) -> DRequest:
        """Plan with context parallelism: one task per (P CP rank, P rank) of each shard."""
        p_info, d_info = cp_layouts(self._config, self._use_mla)
        bs = self._cache.block_size
        external = max(0, meta.prompt_len - meta.num_computed_tokens) if any(meta.local_block_ids) else 0
        # Every group shares the prompt and block size, so its shards have the same CP ranks and P
        # ranks in the same order; only the block ids differ.
        group_shards = [
            []  # a state group is not interleaved over CP ranks: its own tasks read it (below)
            if g in self._cache.state_groups
            else plan_cp_pull(
                p=p_info,
                d=d_info,
                heads=self._cache.heads,
                d_tp_rank=self._tp_rank,
                d_pcp_rank=self._pcp_rank,
                remote_block_ids=remote,
                local_block_ids=local,
                prompt_len=meta.prompt_len,
                num_external_tokens=external,
                p_block_size=meta.remote_block_size or bs,
                d_block_size=bs,
            )
            for g, (local, remote) in enumerate(zip(meta.local_block_ids, meta.remote_block_ids, strict=True))
        ]
        attn = self._cache.attention_groups
        shards = group_shards[attn[0]] if attn else []
        tasks: list[tuple[int, int]] = [(i, w) for i, s in enumerate(shards) for w in s.p_world_ranks]
        if self._cache.has_state:  # the state is replicated over P's CP ranks: read it from P's PCP rank 0
            p_tp, d_tp = self._config.prefill.tp_size, self._config.decode.tp_size
            tasks += [(ShardKind.STATE_ONLY, w) for w in state_source_ranks(self._tp_rank, p_tp, d_tp)]
        slices = list(shards[0].slices) if shards else []
        return DRequest(
            meta,
            now + self._config.pull_timeout_s,
            pending=len(tasks),
            slices=slices,
            shards=shards,
            group_shards=group_shards,
            tasks=[PullTask(world, shard) for shard, world in tasks],
        )

    def task_descriptors(self, pull: DRequest, task: PullTask, port: int, agent: AgentMetadata) -> TaskBatch:
        """The descriptors of one task (read from P's rank at ``port``), after checking that rank is the one it reads.

        Raises:
            ProtocolError: ``agent`` is not the P rank (or PP stage) the task reads.
        """
        meta, shard = pull.meta, task.shard
        p_rank = task.global_rank % meta.remote_ptp_size
        # A WHOLE task's global rank spans P's PP stages; CP shard and state-only tasks read stage 0.
        stage = (port - meta.remote_port) // meta.remote_ptp_size if shard == ShardKind.WHOLE else 0
        check_peer_rank(agent, port=port, pp_rank=stage, tp_rank=p_rank)
        return task_batch(
            self._cache,
            agent,
            meta,
            p_rank=p_rank,
            d_rank=self._tp_rank,
            d_tp=self._config.decode.tp_size,
            slices=pull.slices,
            shards=None if shard < 0 else [gs[shard] if gs else None for gs in pull.group_shards],  # < 0: kind
            state_only=shard == ShardKind.STATE_ONLY,
        )
