"""Mooncake Store backend (``mooncake.store.MooncakeDistributedStore``), any protocol incl. ``tcp``.

Runs in: worker processes (and the scheduler's light client). Design notes, from measurements on
0.3.13 over loopback (see the package README):

* ``setup()`` against an absent master blocks for about 90 s before returning -1, so the backend
  first probes the master's TCP port (bounded by ``probe_timeout_s``) and only then calls setup.
  An unreachable store leaves the backend *disconnected*: calls raise `StoreError` (the pool then
  reports cache misses) and a new attempt is made at most every ``retry_interval_s``.
* With the master down every call takes ~4.4 s and returns -900 (RPC_FAIL). After the first -900 the
  backend opens a circuit for ``retry_interval_s`` (calls raise `StoreError` at once) and resumes
  when the master's port answers again; the native client re-mounts its segment by itself, so a
  restarted master serves new puts and hits again.
* Get results are byte counts on success; they are normalised to 0.
* The TCP transport fails a batch of more than about 2,048 pieces to one peer with -800 (a 2,080-
  piece get of 64 KiB pieces already fails; puts to a remote segment likewise), so callers cut
  batches at ``max_pieces_per_call`` = 1,024 (half, as the count per peer is not exact).
* Upstream rejected every protocol but ``ascend``; here the protocol is a setting.
* ``preferred_segment`` (a memory-contributing client only) makes puts allocate in this client's
  own segment, named by ``get_hostname()`` after setup (with ``P2PHANDSHAKE`` it carries a port
  chosen at setup, so no static setting could name it). A put whose replica is local is a memory
  copy instead of a TCP write: ~2.7x the put throughput of the default placement on loopback
  (5.7 vs 2.1 GB/s for 256 MiB of 64 KiB pieces). When the own segment is full the master
  allocates elsewhere (measured: a 64 MiB segment took 256 MiB of puts, all stored). Mooncake
  0.3.13 ignores ``preferred_segment`` when ``prefer_alloc_in_same_node`` is also set (the puts
  spread over every segment), so the own segment replaces that flag (it is on this node anyway).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from ascend_dist.common.errors import ConfigError, StoreError
from ascend_dist.common.log import log_once
from ascend_dist.kv_store.backends.base import OBJECT_NOT_FOUND, describe_code, normalize_get_codes
from ascend_dist.kv_store.config.config import MooncakeStoreConfig

__all__ = ["MooncakeBackend", "MooncakeStoreClient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_RPC_FAIL = -900
_EXISTS_CODES: frozenset[int] = frozenset({0, 1})  # batch_is_exist: 1 present, 0 absent, negative = error


def _native(items: Sequence[T]) -> list[T] | tuple[T, ...]:
    """``items`` as the binding takes it: lists and tuples pass as they are (no per-call copy)."""
    return items if isinstance(items, list | tuple) else list(items)


def _native_lists(rows: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
    if isinstance(rows, list | tuple) and all(isinstance(r, list | tuple) for r in rows):
        return rows
    return [list(r) for r in rows]


class MooncakeStoreClient(Protocol):
    """The subset of ``MooncakeDistributedStore`` this backend calls (Mooncake ships no stubs)."""

    def setup(self, *args: Any) -> int:
        """Native call."""
        ...

    def register_buffer(self, ptr: int, size: int) -> int:
        """Native call."""
        ...

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """Native call."""
        ...

    def batch_put_from_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]], config: Any
    ) -> list[int]:
        """Native batch call."""
        ...

    def batch_get_into_multi_buffers(
        self, keys: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> list[int]:
        """Native batch call (the binding takes lists or tuples)."""
        ...

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """Native batch call: 0 per removed key, negative per failure."""
        ...

    def remove_all(self, force: bool = False) -> int:
        """Native call."""
        ...

    def close(self) -> int:
        """Native call."""
        ...

    def get_hostname(self) -> str:
        """Native call: this client's segment name (``host:port`` with ``P2PHANDSHAKE``)."""
        ...


def _default_factory() -> MooncakeStoreClient:
    from mooncake.store import MooncakeDistributedStore  # native; imported only when used

    return MooncakeDistributedStore()


def _default_replicate_config(cfg: MooncakeStoreConfig, own_segment: str | None) -> Any:
    """The puts' ``ReplicateConfig``; ``own_segment``: the segment puts prefer (None: the master's choice)."""
    from mooncake.store import ReplicateConfig

    rc = ReplicateConfig()
    if own_segment:  # Mooncake 0.3.13 ignores preferred_segment when prefer_alloc_in_same_node is set
        rc.preferred_segment = own_segment
    else:
        rc.prefer_alloc_in_same_node = cfg.prefer_alloc_in_same_node
    return rc


def master_reachable(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to ``host:port`` succeeds within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


class MooncakeBackend:
    """A `PoolBackend` over Mooncake Store with lazy connect, outage circuit and reconnect."""

    name = "mooncake"
    max_pieces_per_call: int | None = 1024  # below the TCP transport's ~2,048 pieces per peer and batch

    def __init__(
        self,
        config: MooncakeStoreConfig,
        *,
        contribute_memory: bool = True,
        global_rank: int = 0,
        retry_interval_s: float = 2.0,
        probe_timeout_s: float = 0.5,
        store_factory: Callable[[], MooncakeStoreClient] = _default_factory,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create the backend and try to connect once (never blocks on an absent master).

        Args:
            config: Client settings.
            contribute_memory: Whether this client contributes ``global_segment_size`` to the pool
                (workers yes; a scheduler-side lookup client no).
            global_rank: This worker's rank (its SSD offload directory is ``rank_<global_rank>``).
            retry_interval_s: Minimum time between connection attempts and the circuit's open time.
            probe_timeout_s: Bound of the TCP probe of the master.
            store_factory: Creates the native client (injectable for tests of our own logic).
            clock: Monotonic clock.
        """
        self._cfg = config
        self._segment = config.global_segment_size if contribute_memory else 0
        self._local_buffer = config.local_buffer_size if contribute_memory else 0
        self._retry_s = retry_interval_s
        self._probe_s = probe_timeout_s
        self._ssd_dir = (
            os.path.join(config.ssd_offload_path, f"rank_{global_rank}")
            if config.enable_ssd_offload and contribute_memory
            else ""
        )
        self._factory = store_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._store: MooncakeStoreClient | None = None
        self._replicate: Any = None
        self._own_segment: str | None = None  # the segment puts prefer (``preferred_segment``)
        self._regions: list[tuple[int, int]] = []
        self._next_attempt = 0.0
        self._down_until = 0.0
        self._closed = False
        self._connect_locked_attempt()

    @property
    def connected(self) -> bool:
        """Whether a native client is set up."""
        return self._store is not None

    def _connect_locked_attempt(self) -> None:
        with self._lock:
            self._try_connect()

    def _try_connect(self) -> None:
        now = self._clock()
        if self._store is not None or now < self._next_attempt or self._closed:
            return
        self._next_attempt = now + self._retry_s
        addr = self._cfg.master_server_address
        if not master_reachable(addr, self._probe_s):
            log_once(
                logger,
                logging.WARNING,
                "Mooncake master %s unreachable; the pool reports misses and retries every %.1fs",
                addr,
                self._retry_s,
                key=("unreachable", addr),
            )
            return
        store = self._factory()
        args = (
            self._cfg.local_hostname, self._cfg.metadata_server, self._segment, self._local_buffer,
            self._cfg.protocol, self._cfg.device_name, addr,
        )  # fmt: skip
        rc = store.setup(*args) if not self._ssd_dir else self._setup_with_ssd(store, args)
        if rc != 0:
            logger.warning("Mooncake setup against %s returned %d; retrying in %.1fs", addr, rc, self._retry_s)
            return
        for ptr, size in self._regions:
            if store.register_buffer(ptr, size) != 0:
                logger.warning("Mooncake register_buffer(%#x, %d) failed after connect", ptr, size)
        self._own_segment = store.get_hostname() if self._cfg.preferred_segment and self._segment > 0 else None
        self._replicate = (
            _default_replicate_config(self._cfg, self._own_segment) if self._factory is _default_factory else None
        )
        self._store = store
        logger.info(
            "Mooncake store connected: master=%s protocol=%s segment=%d", addr, self._cfg.protocol, self._segment
        )

    def _setup_with_ssd(self, store: MooncakeStoreClient, args: tuple[object, ...]) -> int:
        """``setup`` with SSD offload into this rank's directory (Mooncake needs it to exist).

        Raises:
            ConfigError: The directory cannot be created, or this Mooncake has no SSD offload (< 0.3.11).
        """
        try:
            os.makedirs(self._ssd_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError("ssd_offload_path", self._cfg.ssd_offload_path, f"a writable directory ({exc})") from exc
        try:
            return store.setup(*args, None, True, self._ssd_dir)
        except TypeError as exc:  # the binding rejects the extra arguments
            raise ConfigError("enable_ssd_offload", True, f"false with this Mooncake (needs >= 0.3.11: {exc})") from exc

    def _client(self, op: str) -> MooncakeStoreClient:
        with self._lock:
            if self._closed:
                raise StoreError(f"Mooncake backend closed ({op})")
            self._try_connect()
            store = self._store
            if store is None:
                raise StoreError(f"Mooncake store at {self._cfg.master_server_address} is not connected ({op})")
            if self._clock() < self._down_until:
                raise StoreError(f"Mooncake master {self._cfg.master_server_address} is down ({op}); circuit open")
            if self._down_until and not master_reachable(self._cfg.master_server_address, self._probe_s):
                self._down_until = self._clock() + self._retry_s
                raise StoreError(f"Mooncake master {self._cfg.master_server_address} still unreachable ({op})")
            self._down_until = 0.0
            return store

    def _note_codes(self, op: str, codes: Sequence[int]) -> None:
        if _RPC_FAIL in codes:
            with self._lock:
                self._down_until = self._clock() + self._retry_s
            log_once(
                logger,
                logging.WARNING,
                "Mooncake %s got RPC_FAIL: master down; pausing the pool for %.1fs",
                op,
                self._retry_s,
                key=("rpc_fail", op),
            )

    def native_client(self) -> MooncakeStoreClient:
        """The connected native client, for benchmarks that compare against the raw store.

        Raises:
            StoreError: Not connected.
        """
        return self._client("native_client")

    @property
    def preferred_segment(self) -> str | None:
        """The segment puts prefer: this client's own with ``preferred_segment`` and a segment, else None."""
        return self._own_segment

    @property
    def replicate_config(self) -> Any:
        """The ``ReplicateConfig`` puts use (None before the first connection); benchmarks reuse it."""
        return self._replicate

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Register regions now if connected, and again after every (re)connect.

        Raises:
            StoreError: The connected store refused a region.
        """
        with self._lock:
            self._regions.extend(zip(ptrs, lengths, strict=True))
            store = self._store
        if store is None:
            return
        for ptr, size in zip(ptrs, lengths, strict=True):
            rc = store.register_buffer(ptr, size)
            if rc != 0:
                raise StoreError(f"Mooncake register_buffer({ptr:#x}, {size}) returned {rc}")

    def exists(self, keys: Sequence[str]) -> list[int]:
        """``batch_is_exist``: 1/0 per key.

        Raises:
            StoreError: Not connected, master down, or the store answered -1 / -900.
        """
        if not keys:
            return []
        store = self._client("exists")
        codes = [int(c) for c in store.batch_is_exist(_native(keys))]
        self._note_codes("exists", codes)
        if not _EXISTS_CODES.issuperset(codes):
            bad = [c for c in codes if c not in _EXISTS_CODES]
            raise StoreError(
                f"Mooncake batch_is_exist failed for {len(bad)} of {len(keys)} keys: {describe_code(bad[0])}"
            )
        return codes

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """``batch_put_from_multi_buffers``; an already existing key (-705) counts as stored."""
        if not keys:
            return []
        store = self._client("put")
        codes = [
            int(c)
            for c in store.batch_put_from_multi_buffers(
                _native(keys), _native_lists(addrs), _native_lists(sizes), self._replicate
            )
        ]
        self._note_codes("put", codes)
        codes = [0 if c == -705 else c for c in codes]
        failed = [c for c in codes if c != 0]
        if failed:
            logger.warning(
                "Mooncake put: %d of %d keys failed, first %s", len(failed), len(keys), describe_code(failed[0])
            )
        return codes

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """``batch_get_into_multi_buffers``; byte counts become 0, failures stay negative."""
        if not keys:
            return []
        store = self._client("get")
        raw = store.batch_get_into_multi_buffers(_native(keys), _native_lists(addrs), _native_lists(sizes))
        codes = normalize_get_codes(raw)
        self._note_codes("get", codes)
        return codes

    def remove(self, keys: Sequence[str]) -> None:
        """``batch_remove`` (forced past leases): drops what a cancelled save may have stored; absent keys pass.

        Raises:
            StoreError: Not connected, master down, or a key other than an absent one failed.
        """
        if not keys:
            return
        store = self._client("remove")
        codes = [int(c) for c in store.batch_remove(list(keys), True)]
        self._note_codes("remove", codes)
        bad = [c for c in codes if c not in (0, OBJECT_NOT_FOUND)]
        if bad:
            raise StoreError(
                f"Mooncake batch_remove failed for {len(bad)} of {len(keys)} keys: {describe_code(bad[0])}"
            )

    def close(self) -> None:
        """Close the native client. Idempotent."""
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()
