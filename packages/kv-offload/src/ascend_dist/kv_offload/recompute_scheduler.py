"""Scheduler side of the recompute (preempt) CPU offload connector.

Runs in: the scheduler process. Pure Python over our own pools (no vLLM import; the adapter
translates vLLM's request and block objects).

When the scheduler preempts a request on a decode node, `RecomputeManager.update_state_before_preempt`
reserves host blocks for its computed KV and records device -> host pairs. The next
`build_meta` puts them in one store event with ``need_flush``: workers copy them synchronously in
``handle_preemptions``, before the freed device blocks can be written by another request. When
every worker has acknowledged the store, the request is ready; on re-admission it reports its saved
tokens as an asynchronous external hit, and after allocation the host -> device pairs are loaded.

Per-request lifecycle (an explicit table): SAVING -> READY -> LOADING; the state is dropped when
the load completes, when the request finishes, or when its store failed on some worker (then the
request is simply recomputed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.states import StateTable
from ascend_dist.kv_offload.host_blocks import HostBlockPool
from ascend_dist.kv_offload.messages import NO_EVENT, RecomputeMetadata, RecomputeWorkerMeta
from ascend_dist.kv_offload.recompute_plan import (
    SAVE_TABLE,
    GroupKind,
    GroupSpec,
    SavePhase,
    align_group_block_ids,
    attention_load_pairs,
    mamba_state_index,
)

__all__ = ["DevicePool", "RecomputeManager", "SavePhase"]

logger = logging.getLogger(__name__)


class DevicePool(Protocol):
    """The device block pool's reference counting (vLLM: ``BlockPool.touch`` / ``free_blocks``)."""

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block."""
        ...

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block."""
        ...


@dataclass
class _Saved:
    cpu_block_ids: list[list[int]]
    num_computed_tokens: int
    store_pairs: list[tuple[int, int]]
    store_event: int | None = None
    load_event: int | None = None
    load_pairs: list[tuple[int, int]] | None = None
    load_start_tokens: int = 0
    touched_device: list[int] = field(default_factory=list)
    finished: bool = False


class RecomputeManager:
    """Save preempted requests' KV to host blocks and restore it after re-allocation."""

    def __init__(
        self,
        groups: Sequence[GroupSpec],
        num_cpu_blocks: int,
        *,
        world_size: int = 1,
        num_spec_tokens: int = 0,
        enable_prefix_caching: bool = False,
        device_pool: DevicePool | None = None,
    ) -> None:
        """Create the manager.

        Args:
            groups: the KV-cache groups in order.
            num_cpu_blocks: host blocks (from `capacity.HostCapacity`; the worker allocates as many).
            world_size: workers that must acknowledge a store before it counts.
            num_spec_tokens: speculative tokens (Mamba keeps ``1 + num_spec_tokens`` states).
            enable_prefix_caching: share host blocks between requests by full-block hash.
            device_pool: the device pool; may be bound later with `bind_device_pool`.

        Raises:
            ConfigError: no group, a non-bool ``enable_prefix_caching``, bad counts.
        """
        if not groups:
            raise ConfigError("groups", [], "at least one KV-cache group")
        if not isinstance(enable_prefix_caching, bool):
            raise ConfigError("enable_offload_prefix_caching", enable_prefix_caching, "true or false")
        if world_size < 1 or num_spec_tokens < 0:
            raise ConfigError("world_size/num_spec_tokens", (world_size, num_spec_tokens), ">= 1 and >= 0")
        self.groups = list(groups)
        self.world_size = world_size
        self.num_spec_tokens = num_spec_tokens
        self.prefix_caching = enable_prefix_caching
        self.host = HostBlockPool(num_cpu_blocks)
        self._device = device_pool
        self._saved: dict[str, _Saved] = {}
        self._phase: StateTable[SavePhase] = StateTable(SAVE_TABLE, name="recompute")
        self._preempted_this_step: set[str] = set()
        self._pending_hashes: dict[bytes, int] = {}
        self._next_event = 0
        self._store_reqs: dict[int, list[str]] = {}
        self._store_hashes: dict[int, list[tuple[int, bytes]]] = {}
        self._store_counts: dict[int, int] = {}
        self._load_reqs: dict[int, list[str]] = {}
        self._step_hashes: list[tuple[int, bytes]] = []

    def bind_device_pool(self, pool: DevicePool) -> None:
        """Give the manager the device pool (vLLM's ``bind_gpu_block_pool``)."""
        self._device = pool

    def has_preempted_request(self, req_id: str) -> bool:
        """Whether this connector holds saved KV for ``req_id``."""
        return req_id in self._saved

    # -- preemption ---------------------------------------------------------------------------------

    def update_state_before_preempt(
        self,
        req_id: str,
        block_ids_per_group: Sequence[Sequence[int]],
        num_computed_tokens: int,
        block_hashes: Sequence[bytes] = (),
    ) -> bool:
        """Reserve host blocks for a request about to be preempted; False means "fall back".

        Args:
            req_id: the request.
            block_ids_per_group: its device block ids, per group.
            num_computed_tokens: tokens whose KV is in those blocks.
            block_hashes: hashes of its full blocks (used with prefix caching only).

        Returns:
            True when the KV will be saved this step.

        Raises:
            ConfigError: the group count differs from the manager's.
        """
        if req_id in self._saved:
            return True
        if num_computed_tokens <= 0 or self._device is None:
            return False
        if len(block_ids_per_group) != len(self.groups):
            raise ConfigError("block_ids_per_group", len(block_ids_per_group), f"{len(self.groups)} groups")
        layout = [
            self._positions(g, ids, num_computed_tokens, block_hashes) for g, ids in enumerate(block_ids_per_group)
        ]
        if not any(dev > 0 for group in layout for dev, _ in group):
            return False
        needed = sum(1 for group in layout for dev, h in group if dev > 0 and self._needs_block(h))
        if needed > self.host.num_free:
            logger.warning(
                "recompute offload: %s needs %d host blocks, %d free: fall back", req_id, needed, self.host.num_free
            )
            return False
        fresh = self.host.allocate(needed)
        assert fresh is not None
        saved = _Saved([], num_computed_tokens, [])
        waits = False
        for group in layout:
            host_ids: list[int] = []
            for dev, block_hash in group:
                host, stored, shared = self._place(dev, block_hash, fresh)
                waits = waits or shared
                if stored:
                    saved.store_pairs.append((dev, host))
                host_ids.append(host)
            saved.cpu_block_ids.append(host_ids)
        self._saved[req_id] = saved
        self._phase.add(req_id, SavePhase.SAVING)
        self._preempted_this_step.add(req_id)
        logger.debug(
            "recompute offload: %s saves %d blocks (waits on shared: %s)", req_id, len(saved.store_pairs), waits
        )
        return True

    def _positions(
        self, group: int, ids: Sequence[int], computed: int, hashes: Sequence[bytes]
    ) -> list[tuple[int, bytes | None]]:
        """(device id, hash or None) per saved position of one group."""
        spec = self.groups[group]
        if spec.kind is GroupKind.MAMBA:
            return [(d, None) for d in list(ids)[-(1 + self.num_spec_tokens) :]]
        aligned = align_group_block_ids(
            ids, computed, spec.block_size, sliding_window=spec.kind is GroupKind.SLIDING_WINDOW
        )
        out: list[tuple[int, bytes | None]] = []
        for idx, dev in enumerate(aligned):
            full = (idx + 1) * spec.block_size <= computed
            h = hashes[idx] + group.to_bytes(4, "big") if self.prefix_caching and full and idx < len(hashes) else None
            out.append((dev, h))
        return out

    def _needs_block(self, block_hash: bytes | None) -> bool:
        return block_hash is None or (self.host.cached(block_hash) is None and block_hash not in self._pending_hashes)

    def _place(self, dev: int, block_hash: bytes | None, fresh: list[int]) -> tuple[int, bool, bool]:
        """Host id for one position: (host id, needs a store, shares a block pending this step)."""
        if dev <= 0:
            return 0, False, False
        if block_hash is not None:
            cached = self.host.cached(block_hash)
            if cached is not None:
                self.host.touch(cached)
                return cached, False, False
            pending = self._pending_hashes.get(block_hash)
            if pending is not None:
                self.host.touch(pending)
                return pending, False, True
        host = fresh.pop()
        if block_hash is not None:
            self._pending_hashes[block_hash] = host
            self._step_hashes.append((host, block_hash))
        return host, True, False

    # -- re-admission -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, req_id: str, num_tokens: int, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``(0, False)`` nothing saved; ``(None, False)`` store not confirmed yet; ``(n, True)`` async hit."""
        saved = self._saved.get(req_id)
        if saved is None:
            return 0, False
        phase = self._phase.state(req_id)
        if phase is SavePhase.SAVING:
            return None, False
        if phase is SavePhase.LOADING:
            return 0, False
        hit = min(saved.num_computed_tokens, num_tokens) - num_computed_tokens
        if hit <= 0:
            self._drop(req_id)
            return 0, False
        saved.load_start_tokens = num_computed_tokens
        return hit, True

    def update_state_after_alloc(
        self, req_id: str, num_tokens: int, block_ids_per_group: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Build the restore pairs into the freshly allocated device blocks and pin those blocks.

        Raises:
            ConfigError: group count mismatch or an empty/impossible load range.
        """
        saved = self._saved.get(req_id)
        if saved is None or num_external_tokens <= 0:
            return
        if len(block_ids_per_group) != len(self.groups):
            raise ConfigError("block_ids_per_group", len(block_ids_per_group), f"{len(self.groups)} groups")
        start = saved.load_start_tokens
        end = min(start + num_external_tokens, saved.num_computed_tokens)
        if end <= start:
            raise ConfigError("num_external_tokens", num_external_tokens, f"a non-empty range from token {start}")
        pairs: list[tuple[int, int]] = []
        for g, (spec, device_ids) in enumerate(zip(self.groups, block_ids_per_group, strict=True)):
            host_ids = saved.cpu_block_ids[g]
            if spec.kind is GroupKind.MAMBA:
                index = mamba_state_index(self.num_spec_tokens, saved.num_computed_tokens, num_tokens)
                targets = [d for d in device_ids if d > 0]
                if index < len(host_ids) and host_ids[index] > 0 and targets:
                    pairs.append((host_ids[index], targets[0]))
                continue
            sliding = spec.kind is GroupKind.SLIDING_WINDOW
            pairs += attention_load_pairs(host_ids, device_ids, start, end, spec.block_size, sliding_window=sliding)
        saved.load_pairs = pairs
        saved.touched_device = [dev for _, dev in pairs]
        assert self._device is not None
        self._device.touch(saved.touched_device)
        self._phase.advance(req_id, SavePhase.LOADING)

    # -- per step -----------------------------------------------------------------------------------

    def build_meta(self) -> RecomputeMetadata:
        """This step's store and load events (see `RecomputeMetadata`); resets per-step state."""
        store_event, store_pairs = NO_EVENT, []
        waiting = [
            r for r, s in self._saved.items() if s.store_event is None and self._phase.state(r) is SavePhase.SAVING
        ]
        if waiting:
            store_event = self._new_event()
            for req_id in waiting:
                self._saved[req_id].store_event = store_event
                store_pairs += self._saved[req_id].store_pairs
            self._store_reqs[store_event] = waiting
            self._store_hashes[store_event] = self._step_hashes
        load_event, load_pairs = NO_EVENT, []
        loading = [r for r, s in self._saved.items() if s.load_pairs is not None and s.load_event is None]
        if loading:
            load_event = self._new_event()
            for req_id in loading:
                self._saved[req_id].load_event = load_event
                load_pairs += self._saved[req_id].load_pairs or []
            self._load_reqs[load_event] = loading
        meta = RecomputeMetadata(
            need_flush=bool(self._preempted_this_step),
            store_event=store_event,
            store_gpu_blocks=tuple(d for d, _ in store_pairs),
            store_cpu_blocks=tuple(h for _, h in store_pairs),
            load_event=load_event,
            load_gpu_blocks=tuple(d for _, d in load_pairs),
            load_cpu_blocks=tuple(h for h, _ in load_pairs),
            load_event_to_reqs={e: tuple(r) for e, r in self._load_reqs.items()},
        )
        self._preempted_this_step.clear()
        self._pending_hashes.clear()
        self._step_hashes = []
        return meta

    def _new_event(self) -> int:
        self._next_event += 1
        return self._next_event

    def update_connector_output(self, finished_recving: Iterable[str], worker_meta: RecomputeWorkerMeta | None) -> None:
        """Consume finished loads and the workers' (aggregated) store acknowledgements."""
        for req_id in finished_recving:
            saved = self._saved.get(req_id)
            if saved is None or saved.load_event is None:
                continue
            reqs = self._load_reqs.get(saved.load_event, [])
            if req_id in reqs:
                reqs.remove(req_id)
            if not reqs:
                self._load_reqs.pop(saved.load_event, None)
            self._drop(req_id)
        if worker_meta is None:
            return
        for event in worker_meta.failed_stores:
            self._fail_store(event)
        for event, count in worker_meta.completed_stores.items():
            if event not in self._store_reqs:
                continue
            self._store_counts[event] = self._store_counts.get(event, 0) + count
            if self._store_counts[event] >= self.world_size:
                self._complete_store(event)

    def _complete_store(self, event: int) -> None:
        del self._store_counts[event]
        for host, block_hash in self._store_hashes.pop(event, []):
            self.host.set_hash(host, block_hash)
        for req_id in self._store_reqs.pop(event):
            if req_id not in self._saved:
                continue
            self._phase.advance(req_id, SavePhase.READY)
            if self._saved[req_id].finished:
                self._drop(req_id)

    def _fail_store(self, event: int) -> None:
        self._store_counts.pop(event, None)
        self._store_hashes.pop(event, None)
        for req_id in self._store_reqs.pop(event, []):
            if req_id in self._saved:
                logger.warning("recompute offload: store of %s failed; it will be recomputed", req_id)
                self._drop(req_id)

    def _drop(self, req_id: str) -> None:
        saved = self._saved.pop(req_id)
        self._phase.pop(req_id)
        if saved.touched_device and self._device is not None:
            self._device.free(saved.touched_device)
        self.host.free(h for group in saved.cpu_block_ids for h in group)

    # -- finish, reset --------------------------------------------------------------------------------

    def request_finished(self, req_id: str) -> tuple[bool, None]:
        """Drop a ready request's state, or mark it to be dropped when its store completes."""
        saved = self._saved.get(req_id)
        if saved is not None and saved.load_event is None:
            if self._phase.state(req_id) is SavePhase.SAVING:
                saved.finished = True
            else:
                self._drop(req_id)
        return False, None

    def has_pending_transfers(self) -> bool:
        """Stores awaiting acknowledgement, or states not ready or still loading."""
        return bool(self._store_reqs) or any(self._phase.state(r) is not SavePhase.READY for r in self._saved)

    def reset_cache(self) -> bool:
        """Drop everything and the host hashes; refused (False) while transfers are pending."""
        if self.has_pending_transfers():
            return False
        for req_id in list(self._saved):
            self._drop(req_id)
        self.host.reset()
        return True
