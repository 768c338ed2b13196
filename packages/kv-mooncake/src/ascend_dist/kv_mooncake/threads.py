"""D's receiving side: a thread pool pulling each request's blocks from the P ranks it needs.

Runs in: D worker processes. `Receiver.submit` plans one task per P rank (and PP stage) and hands
them to a bounded `ThreadPoolExecutor`. A task fetches (and caches) the P worker's metadata after a
compatibility handshake, builds descriptors with `ascend_dist.kv_mooncake.plan`, pulls them with
``batch_transfer_sync_read`` and always sends DONE to that P rank, even on failure, so P frees its
blocks (after the request is reported, so DONE's round trip is not on D's critical path). A
failed task records the logical block ids it was to fill, in every KV group, *before* its request
is reported finished. A request still pulling after ``pull_timeout_s`` is reported
failed (its late results are ignored).

Quarantine (spec §15 item 14): a failed or timed-out read may still write into D's blocks later
(Mooncake #4247), so its request's blocks are reported as load errors at once but the request
reaches ``finished_recving`` (and vLLM may reuse the blocks) only when none of its reads runs and
``quarantine_s`` has passed since the last failed read; a read that never returns is given up one
more ``pull_timeout_s`` after the deadline (logged).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ascend_dist.common.descriptors import Descriptors
from ascend_dist.common.errors import ConfigError, IncompatiblePeer, ProtocolError
from ascend_dist.common.mappings import context_parallel_parameters_check
from ascend_dist.common.wire import Codec, Handshake, check_compatible
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.config import PullConfig
from ascend_dist.kv_mooncake.cp_plan import CpShard, cp_layouts, cp_sources, plan_cp_pull
from ascend_dist.kv_mooncake.engine import TransferBackend
from ascend_dist.kv_mooncake.messages import (
    Ack,
    AgentMetadata,
    Done,
    GetMeta,
    MetaReply,
    Refused,
    Renew,
    Reply,
    Request,
    reply_codec,
    request_codec,
)
from ascend_dist.kv_mooncake.plan import (
    HeadSlice,
    PullMode,
    TensorGeom,
    build_pull_descriptors,
    pull_mode,
    select_sources,
)
from ascend_dist.kv_mooncake.plan_groups import pair_group_blocks
from ascend_dist.kv_mooncake.scheduler import ReqMeta

__all__ = ["LocalCache", "Receiver"]

logger = logging.getLogger(__name__)

Reformat = Callable[[str, Sequence[int], int], None]
"""``reformat(layer_name, local_block_ids, pulls)``: stacked pulls -> token-major heads."""


@dataclass(frozen=True)
class LocalCache:
    """D's registered cache as the receiver needs it.

    Attributes:
        layers: Layer name -> its tensors' geometry.
        groups: Per KV-cache group, its layer names.
        block_size: Tokens per logical block.
        heads: Total KV heads of the model (1 for MLA).
    """

    layers: dict[str, list[TensorGeom]]
    groups: list[list[str]]
    block_size: int
    heads: int


@dataclass
class _Pull:
    """A request being pulled."""

    meta: ReqMeta
    slices: list[HeadSlice]
    pending: int
    deadline: float
    submitted: float
    failed: bool = False
    pulled_layers: set[str] = field(default_factory=set)
    hold_until: float = 0.0
    shards: list[CpShard] = field(default_factory=list)


class Receiver:
    """D's thread pool of pulls, completion tracking and load-error reporting."""

    def __init__(
        self,
        config: PullConfig,
        tp_rank: int,
        cache: LocalCache,
        engine: TransferBackend,
        *,
        handshake: Handshake,
        reformat: Reformat,
        clock: Callable[[], float] = time.monotonic,
        pcp_rank: int = 0,
        use_mla: bool = False,
    ) -> None:
        """Start the pool (threads are created on demand)."""
        self._config = config
        self._pcp_rank = pcp_rank
        self._use_mla = use_mla
        if config.uses_cp:  # refuse a bad CP layout at registration, not per request
            if len(cache.groups) != 1:
                raise ConfigError("kv_cache_groups", len(cache.groups), "1 (one full-attention group) with CP")
            p_info, d_info = cp_layouts(config, use_mla)
            context_parallel_parameters_check(p_info, d_info, cache.heads)
            cp_sources(tp_rank, p_info, d_info, cache.heads)
        self._tp_rank = tp_rank
        self._cache = cache
        self._engine = engine
        self._handshake = handshake
        self._reformat = reformat
        self._clock = clock
        self._client = RpcClient(
            timeout_s=config.rpc_timeout_s, retries=config.rpc_retries, max_reply_bytes=config.max_message_bytes
        )
        self._requests: Codec[Request] = request_codec(config.max_message_bytes)
        self._replies: Codec[Reply] = reply_codec(config.max_message_bytes)
        self._pool = ThreadPoolExecutor(max_workers=config.recv_workers, thread_name_prefix=f"kv-pull-{tp_rank}")
        self._lock = threading.Lock()
        self._pulls: dict[str, _Pull] = {}
        self._finished: set[str] = set()
        self._quarantined: dict[str, _Pull] = {}
        self._errors: set[int] = set()
        self._meta_cache: dict[tuple[str, str, int], AgentMetadata] = {}

    @property
    def in_flight(self) -> int:
        """Requests still pulling."""
        with self._lock:
            return len(self._pulls)

    @property
    def quarantined(self) -> int:
        """Failed requests whose blocks are held because a late write could still land."""
        with self._lock:
            return len(self._quarantined)

    @property
    def cached_peers(self) -> int:
        """P workers whose metadata is cached."""
        with self._lock:
            return len(self._meta_cache)

    def peer_metadata(self, engine_id: str, host: str, port: int) -> AgentMetadata | None:
        """The cached metadata of a P worker, if fetched (the benchmark rebuilds descriptors from it)."""
        with self._lock:
            return self._meta_cache.get((engine_id, host, port))

    def submit(self, meta: ReqMeta) -> None:
        """Plan a request's pulls and queue them (an empty receive only sends DONEs)."""
        if meta.do_virtual:
            with self._lock:
                self._finished.add(meta.request_id)
            return
        if self._config.uses_cp:
            self._submit_cp(meta)
            return
        p_tp, p_pp = meta.remote_ptp_size, self._config.prefill.pp_size
        slices = select_sources(
            self._tp_rank, p_tp, self._config.decode.tp_size, self._cache.heads, meta.remote_request_id
        )
        ranks = sorted({s.p_rank for s in slices})
        tasks = [stage * p_tp + p for stage in range(p_pp) for p in ranks]
        now = self._clock()
        with self._lock:
            self._pulls[meta.request_id] = _Pull(meta, slices, len(tasks), now + self._config.pull_timeout_s, now)
        for global_rank in tasks:
            self._pool.submit(self._run_task, meta.request_id, global_rank)

    def _submit_cp(self, meta: ReqMeta) -> None:
        """Plan with context parallelism (spec §5.11): one task per (P CP rank, P rank) of each shard."""
        p_info, d_info = cp_layouts(self._config, self._use_mla)
        bs = self._cache.block_size
        shards = plan_cp_pull(
            p=p_info,
            d=d_info,
            heads=self._cache.heads,
            d_tp_rank=self._tp_rank,
            d_pcp_rank=self._pcp_rank,
            remote_block_ids=meta.remote_block_ids[0],
            local_block_ids=meta.local_block_ids[0],
            prompt_len=meta.prompt_len,
            num_external_tokens=max(0, meta.prompt_len - meta.num_computed_tokens) if any(meta.local_block_ids) else 0,
            p_block_size=bs,
            d_block_size=bs,
        )
        tasks = [(i, w) for i, s in enumerate(shards) for w in s.p_world_ranks]
        now = self._clock()
        slices = list(shards[0].slices) if shards else []
        with self._lock:
            self._pulls[meta.request_id] = _Pull(
                meta, slices, len(tasks), now + self._config.pull_timeout_s, now, shards=shards
            )
        for shard, world in tasks:
            self._pool.submit(self._run_task, meta.request_id, world, shard)

    def _run_task(self, request_id: str, global_rank: int, shard: int = -1) -> None:
        with self._lock:
            pull = self._pulls.get(request_id)
        if pull is None:
            return
        meta = pull.meta
        port = meta.remote_port + global_rank
        ok = True
        try:
            if shard >= 0:
                if pull.shards[shard].local_ids:
                    self._pull(pull, port, global_rank % meta.remote_ptp_size, pull.shards[shard])
            elif any(meta.local_block_ids):
                self._pull(pull, port, global_rank % meta.remote_ptp_size)
        except Exception as exc:  # every failure becomes load errors, never a crash
            ok = False
            logger.error("request %s: pull from %s:%d failed: %s", request_id, meta.remote_host, port, exc)
            with self._lock:
                self._meta_cache.pop((meta.remote_engine_id, meta.remote_host, port), None)
            self._fail(pull)
        finally:
            # Report the request first (D's latency), then release P's blocks with DONE.
            self._task_done(pull)
            self._send_done(meta, port, ok)

    def _pull(self, pull: _Pull, port: int, p_rank: int, shard: CpShard | None = None) -> None:
        meta = pull.meta
        agent = self._metadata(meta.remote_engine_id, meta.remote_host, port)
        if self._clock() - pull.submitted > self._config.lease_s / 3:
            self._rpc(meta.remote_host, port, Renew(request_ids=[meta.remote_request_id]))
        batches: list[Descriptors] = []
        layers: list[str] = []
        for g, names in enumerate(self._cache.groups):
            if shard is None:
                local_ids, remote_ids = pair_group_blocks(meta, g, self._cache.block_size)
                slices = pull.slices
            else:
                local_ids, remote_ids, slices = list(shard.local_ids), list(shard.remote_ids), list(shard.slices)
            if remote_ids and max(remote_ids) >= agent.num_blocks:
                raise ProtocolError(f"remote block id {max(remote_ids)} >= P's {agent.num_blocks} blocks")
            here = [n for n in names if n in agent.layers]
            local = [geom for n in here for geom in self._cache.layers[n]]
            remote = [
                TensorGeom(t.base, t.block_len, t.stride, t.tokens, t.heads, t.head_bytes)
                for n in here
                for t in agent.layers[n]
            ]
            batches.append(build_pull_descriptors(local, remote, local_ids, remote_ids, slices=slices, p_rank=p_rank))
            layers.extend(here)
        try:
            self._engine.read(
                agent.te_session, Descriptors.concat(batches), timeout_s=max(0.1, pull.deadline - self._clock())
            )
        except BaseException:
            with self._lock:  # the engine may still write into these blocks: quarantine them
                pull.hold_until = max(pull.hold_until, self._clock() + self._config.quarantine_s)
            raise
        with self._lock:
            pull.pulled_layers.update(layers)

    def _metadata(self, engine_id: str, host: str, port: int) -> AgentMetadata:
        key = (engine_id, host, port)
        with self._lock:
            cached = self._meta_cache.get(key)
        if cached is not None:
            return cached
        if engine_id == self._config.engine_id:
            raise IncompatiblePeer("engine_id", self._config.engine_id, engine_id)
        reply = self._rpc(host, port, GetMeta(handshake=self._handshake, engine_id=self._config.engine_id))
        if isinstance(reply, Refused):
            raise IncompatiblePeer(reply.field, reply.remote, reply.local)
        if not isinstance(reply, MetaReply):
            raise ProtocolError(f"expected metadata from {host}:{port}, got {type(reply).__name__}")
        check_compatible(self._handshake, reply.handshake)
        if reply.metadata.engine_id != engine_id:
            raise IncompatiblePeer("remote_engine_id", engine_id, reply.metadata.engine_id)
        with self._lock:
            self._meta_cache[key] = reply.metadata
        return reply.metadata

    def _rpc(self, host: str, port: int, message: Request) -> Reply:
        body = self._client.request(tcp_endpoint(host, port), self._requests.encode(message))
        return self._replies.decode(body)

    def _send_done(self, meta: ReqMeta, port: int, ok: bool) -> None:
        try:
            reply = self._rpc(
                meta.remote_host, port, Done(request_id=meta.remote_request_id, d_rank=self._tp_rank, ok=ok)
            )
            if not isinstance(reply, Ack):
                logger.warning(
                    "DONE for %s to port %d answered by %s", meta.remote_request_id, port, type(reply).__name__
                )
        except Exception as exc:  # P's lease frees its blocks if DONE is lost
            logger.warning(
                "DONE for %s to %s:%d not delivered: %s", meta.remote_request_id, meta.remote_host, port, exc
            )

    def _fail(self, pull: _Pull) -> None:
        with self._lock:
            if pull.failed:  # reported once (a timed-out request's late task fails again)
                return
            pull.failed = True
            for ids in pull.meta.local_block_ids:
                self._errors.update(ids)

    def _task_done(self, pull: _Pull) -> None:
        with self._lock:
            pull.pending -= 1
            if pull.pending > 0 or self._pulls.get(pull.meta.request_id) is not pull:
                return  # a timed-out request waits in quarantine for pending == 0
            wanted = {n for g, names in enumerate(self._cache.groups) if pull.meta.local_block_ids[g] for n in names}
        if not pull.failed and wanted - pull.pulled_layers:
            logger.error(
                "request %s: layers %s not served by any P stage",
                pull.meta.request_id,
                sorted(wanted - pull.pulled_layers)[:4],
            )
            self._fail(pull)
        if not pull.failed:
            try:
                self._reformat_all(pull)
            except Exception as exc:
                logger.error("request %s: reformat failed: %s", pull.meta.request_id, exc)
                self._fail(pull)
        with self._lock:
            self._pulls.pop(pull.meta.request_id, None)
            if pull.failed and self._clock() < pull.hold_until:
                self._quarantined[pull.meta.request_id] = pull
            elif not pull.meta.notify_only:
                self._finished.add(pull.meta.request_id)

    def _reformat_all(self, pull: _Pull) -> None:
        first = (
            self._cache.layers[self._cache.groups[0][0]][0] if self._cache.groups and self._cache.groups[0] else None
        )
        if first is None:
            return
        p_heads = pull.slices[0].n_heads
        if pull_mode(pull.slices, p_heads, first.heads) is not PullMode.STACKED:
            return
        for g, names in enumerate(self._cache.groups):
            if pull.shards:
                ids = [b for s in pull.shards for b in s.local_ids]
            else:
                ids, _ = pair_group_blocks(pull.meta, g, self._cache.block_size)
            for name in names:
                if ids:
                    self._reformat(name, ids, len(pull.slices))

    def take_finished(self) -> set[str]:
        """Requests whose pulls ended (ok or failed); those past their deadline are failed now."""
        now = self._clock()
        with self._lock:
            for rid, pull in list(self._pulls.items()):
                if now >= pull.deadline:
                    logger.error(
                        "request %s: pulls not done within %.1f s; reported failed", rid, self._config.pull_timeout_s
                    )
                    pull.failed = True
                    for ids in pull.meta.local_block_ids:
                        self._errors.update(ids)
                    del self._pulls[rid]
                    self._quarantined[rid] = pull  # its reads may still be running
            for rid, pull in list(self._quarantined.items()):
                if pull.meta.notify_only:
                    pass  # vLLM no longer holds the request: nothing to report, only forget it
                elif pull.pending <= 0 and now >= pull.hold_until:
                    self._finished.add(rid)
                elif now >= pull.deadline + self._config.pull_timeout_s:
                    logger.error(
                        "request %s: a read still runs %.1f s after its deadline; releasing its blocks anyway",
                        rid,
                        self._config.pull_timeout_s,
                    )
                    self._finished.add(rid)
                else:
                    continue
                del self._quarantined[rid]
            out, self._finished = self._finished, set()
            return out

    def take_load_errors(self) -> set[int]:
        """Logical block ids (all groups) whose load failed since the last call."""
        with self._lock:
            out, self._errors = self._errors, set()
            return out

    def close(self) -> None:
        """Wait for running pulls (each bounded by the engine's timeout), then close sockets."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()
