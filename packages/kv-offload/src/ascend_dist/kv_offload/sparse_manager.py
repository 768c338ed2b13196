"""Sparse KV offload manager: host pool, hot buffers and the per-step copies.

Runs in: the decode worker process (single-process form: the TP-shared MemFabric pool of the
hardware path is one host allocation here; TP ranks other than 0 are out of scope).

Per main layer the host pool holds K ``[num_blocks * block_size, kv_lora_rank]`` and V
``[..., rope_dim]`` rows (carved at 2 MiB-aligned offsets of one allocation, so K->V and
layer->layer deltas are uniform), and the device holds a hot-buffer pair ``[rows, cap, dim]``.
`offload_new_kv` writes each decode token's K/V straight to its host slot; `onload_topk_kv` plans
the row's top-k residency (`LruResidency`) and copies only the misses host -> hot buffer. Invalid
slots or table entries copy 0 bytes. `get_manager` / `reset_manager` hold the process
singleton; its host pool is shared with SFA's D worker on the same device (whichever comes first
allocates it, see `ascend_dist.common.host_pool_share`), so decode reads the rows P sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ascend_dist.common.device import CopyDirection, DeviceRuntime, Stream
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.host_pool_share import (
    HostPoolGeometry,
    SharedHostPool,
    TensorHostPool,
    claim_host_pool,
    release_host_pool,
)
from ascend_dist.kv_offload.sparse_lru import LruResidency, MissPlan, miss_descriptors
from ascend_dist.kv_offload.sparse_plan import ALIGN_2MB, host_pool_layout

__all__ = ["SparseGeometry", "SparseOffloadManager", "get_manager", "reset_manager"]

_I64 = npt.NDArray[np.int64]
WAIT_S = 60.0


@dataclass(frozen=True)
class SparseGeometry:
    """Sizes of the sparse offload buffers.

    Attributes:
        num_layers: main (MLA) layers offloaded to host.
        num_blocks: host blocks (from the planner).
        block_size: tokens per block.
        kv_lora_rank / rope_dim: K and V elements per token (bf16: 2 bytes each).
        rows: decode rows of the hot buffer.
        topk: the indexer's top-k.
        cap: hot-buffer slots per row (``topk_buffer_size``).
        max_model_len: longest sequence.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    kv_lora_rank: int
    rope_dim: int
    rows: int
    topk: int
    cap: int
    max_model_len: int


class SparseOffloadManager:
    """Host pool, hot buffers, LRU state and copies of every main layer."""

    def __init__(self, runtime: DeviceRuntime, geo: SparseGeometry, *, share_host_pool: bool = False) -> None:
        """Allocate the host pool (one aligned allocation) and the hot buffers.

        With ``share_host_pool`` (`get_manager`'s form) the host pool is claimed through
        `ascend_dist.common.host_pool_share` for the runtime's device: if SFA's D worker claimed it
        first, the manager reads the rows D wrote; otherwise D will write into this one.

        Raises:
            ConfigError: a non-positive size or ``cap`` not a multiple of ``block_size``; a shared
                pool of another geometry (``host_pool.<field>``).
        """
        if geo.cap % geo.block_size:
            raise ConfigError("topk_buffer_size", geo.cap, f"a multiple of block_size ({geo.block_size})")
        self.rt, self.geo = runtime, geo
        self.tk, self.tv = geo.kv_lora_rank * 2, geo.rope_dim * 2
        self._shared: SharedHostPool | None = None
        if share_host_pool:
            shape = HostPoolGeometry(
                geo.num_layers, geo.num_blocks, geo.block_size, (self.tk, self.tv), token_major=True
            )
            pool = claim_host_pool(runtime.device_index, shape, self._allocate_pool, type(self).__name__)
            self._shared = pool
            self.host_k = [pool.part(i, 0) for i in range(geo.num_layers)]
            self.host_v = [pool.part(i, 1) for i in range(geo.num_layers)]
        else:
            self._allocate_pool()
        self.hot_k: list[torch.Tensor] = []
        self.hot_v: list[torch.Tensor] = []
        for _ in range(geo.num_layers):
            hot = runtime.empty(geo.rows * geo.cap * (self.tk + self.tv), torch.int8)  # one buffer: K then V
            self.hot_k.append(hot[: geo.rows * geo.cap * self.tk].view(geo.rows, geo.cap, self.tk))
            self.hot_v.append(hot[geo.rows * geo.cap * self.tk :].view(geo.rows, geo.cap, self.tv))
        self.lru = [LruResidency(geo.rows, geo.cap, geo.topk, geo.max_model_len) for _ in range(geo.num_layers)]
        self.d2h: Stream = runtime.new_stream()
        self.h2d: Stream = runtime.new_stream()
        self._last_plan: MissPlan | None = None

    def _allocate_pool(self) -> TensorHostPool:
        """K and V of every layer at 2 MiB-aligned offsets of one allocation (uniform K->V, layer->layer deltas)."""
        geo = self.geo
        tokens = geo.num_blocks * geo.block_size
        sizes = [n for _ in range(geo.num_layers) for n in (tokens * self.tk, tokens * self.tv)]
        raw_bytes, offsets = host_pool_layout(sizes)
        self._raw = self.rt.pinned_empty(raw_bytes, torch.int8)
        base = (self._raw.data_ptr() + ALIGN_2MB - 1) // ALIGN_2MB * ALIGN_2MB - self._raw.data_ptr()
        self.host_k = [self._host(base + offsets[2 * i], tokens, self.tk) for i in range(geo.num_layers)]
        self.host_v = [self._host(base + offsets[2 * i + 1], tokens, self.tv) for i in range(geo.num_layers)]
        shape = HostPoolGeometry(geo.num_layers, geo.num_blocks, geo.block_size, (self.tk, self.tv), token_major=True)
        return TensorHostPool(shape, [(k, v) for k, v in zip(self.host_k, self.host_v, strict=True)])

    def _host(self, offset: int, tokens: int, width: int) -> torch.Tensor:
        return self._raw[offset : offset + tokens * width].view(tokens, width)

    def offload_new_kv(self, layer: int, slot_mapping: _I64, k: torch.Tensor, v: torch.Tensor) -> int:
        """Copy each token's K/V rows (``[n, tk]``, ``[n, tv]`` bytes) to host slot ``slot_mapping[t]``.

        Slots outside ``[0, capacity)`` copy 0 bytes. Returns the descriptor count (``2n``).

        Raises:
            ConfigError: more tokens than rows given.
        """
        slots = np.asarray(slot_mapping, dtype=np.int64)
        n = slots.size
        if k.shape[0] < n or v.shape[0] < n:
            raise ConfigError("slot_mapping", n, f"at most {min(k.shape[0], v.shape[0])} token rows")
        cap = self.host_k[layer].shape[0]
        valid = (slots >= 0) & (slots < cap)
        clamped = np.clip(slots, 0, cap - 1)
        t = np.arange(n, dtype=np.int64)
        src = np.concatenate([k.data_ptr() + t * self.tk, v.data_ptr() + t * self.tv])
        dst = np.concatenate(
            [self.host_k[layer].data_ptr() + clamped * self.tk, self.host_v[layer].data_ptr() + clamped * self.tv]
        )
        sizes = np.concatenate([np.where(valid, self.tk, 0), np.where(valid, self.tv, 0)])
        self.d2h.wait_stream(self.rt.current_stream())
        self.rt.batch_copy(src, dst, sizes, CopyDirection.D2H, stream=self.d2h)
        return 2 * n

    def onload_topk_kv(
        self, layer: int, topk: _I64, req_ids: _I64, stable_prefix: _I64, block_table: _I64, *, skip_topk: bool = False
    ) -> _I64:
        """Plan residency for this layer (or reuse the previous layer's plan) and load the misses.

        Returns:
            ``current_slots [rows, topk]`` for sparse attention over the hot buffer.
        """
        self.d2h.synchronize(WAIT_S)  # new tokens are on the host before anyone reads them
        plan = (
            self._last_plan
            if skip_topk and self._last_plan is not None
            else self.lru[layer].step(topk, req_ids, stable_prefix)
        )
        self._last_plan = plan
        src, dst, sizes = miss_descriptors(
            plan, block_table, host_k=self.host_k[layer].data_ptr(), host_v=self.host_v[layer].data_ptr(),
            dev_k=self.hot_k[layer].data_ptr(), dev_v=self.hot_v[layer].data_ptr(), token_k_bytes=self.tk,
            token_v_bytes=self.tv, block_size=self.geo.block_size, cap=self.geo.cap,
        )  # fmt: skip
        self.rt.batch_copy(src, dst, sizes, CopyDirection.H2D, stream=self.h2d)
        self.rt.current_stream().wait_stream(self.h2d)
        return plan.current_slots

    def synchronize(self) -> None:
        """Wait for both copy streams."""
        self.d2h.synchronize(WAIT_S)
        self.h2d.synchronize(WAIT_S)

    def close(self) -> None:
        """Wait for the copies and drop this manager's claim on a shared host pool."""
        self.synchronize()
        if self._shared is not None:
            release_host_pool(self.rt.device_index, self._shared)
            self._shared = None


class _Singleton:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.manager: SparseOffloadManager | None = None


_PROCESS = _Singleton()


def get_manager(runtime: DeviceRuntime | None = None, geo: SparseGeometry | None = None) -> SparseOffloadManager:
    """The process's manager, created on the first call (which must pass runtime and geometry).

    Raises:
        ConfigError: first call without runtime/geometry, or a later call with another geometry.
    """
    with _PROCESS.lock:
        if _PROCESS.manager is None:
            if runtime is None or geo is None:
                raise ConfigError("sparse_kv_offload_manager", None, "runtime and geometry on the first call")
            _PROCESS.manager = SparseOffloadManager(runtime, geo, share_host_pool=True)
        elif geo is not None and geo != _PROCESS.manager.geo:
            raise ConfigError("geometry", geo, f"the process manager's {_PROCESS.manager.geo}")
        return _PROCESS.manager


def reset_manager() -> None:
    """Forget the process manager (tests, engine shutdown)."""
    with _PROCESS.lock:
        if _PROCESS.manager is not None:
            _PROCESS.manager.close()
        _PROCESS.manager = None
