"""The one engine interface of every transport, and its Mooncake adapter (one engine per process).

Runs in: worker processes. `TransferBackend` is what the transports need from an engine: a session
address, region registration, and batch reads (pull, SFA) or writes (push); each transport types its
engine with the narrowest view (`Reader`, `Writer`). `MooncakeEngine` implements all of it; the
SFA connector's MemFabric adapter implements `Reader` (`ascend_dist.kv_mooncake.core.memfabric`).

The Mooncake engine is created lazily, once per process and protocol, with
``initialize(host, "P2PHANDSHAKE", protocol, device)``. Registration is keyed by region and
reference-counted, so several connectors in one process each register what they need (upstream
silently ignored every registration after the first). Reads and writes are split into batches of
at most 2,048 pieces, and the pieces in flight to one peer are capped at 2,048 across all threads
of the process: Mooncake's TCP transport fails (-1) once more than that are queued for one peer, even
when they come from several concurrent batches (measured: 4 threads x 640 pieces).

Once a peer's read rate is known, a read expected to take 5 ms or more is submitted with
``batch_transfer_async_read`` and its thread sleeps through most of that time before Mooncake's
status wait, which spins a core until the batch ends (`ascend_dist.kv_mooncake.core.transfer_pace`
says why and how long); a shorter one is one ``batch_transfer_sync_read``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from ascend_dist.common.errors import ConfigError, NativeLibraryError, TransferError, TransferTimeout
from ascend_dist.common.regions import RegisterRegions, validate_register_region_count
from ascend_dist.kv_mooncake.core.descriptors import MOONCAKE_TCP_MAX_PIECES, Descriptors
from ascend_dist.kv_mooncake.core.tcp_sockets import listening_ports
from ascend_dist.kv_mooncake.core.transfer_pace import TransferPace

__all__ = [
    "MooncakeEngine",
    "Reader",
    "Regions",
    "TransferBackend",
    "WritePieces",
    "Writer",
    "get_engine",
    "reset_engines_for_tests",
]

logger = logging.getLogger(__name__)

# What ``batch_transfer_async_read`` returns when it submitted nothing: 0 when the engine refused
# the batch, -1 as an unsigned 64-bit batch id when the peer's segment could not be opened.
_NO_BATCH = frozenset({0, 2**64 - 1, -1})
# A status wait that spun less than this found its batch already done when it began.
_DONE_AT_ONCE_S = 0.0005


WritePieces = tuple[list[int], list[int], list[int]]
"""``(local addresses, peer addresses, lengths)`` of one push (the push plan's ``Pieces``)."""


class Regions(Protocol):
    """The part of the engine interface every transport uses: its address and memory registration."""

    @property
    def session(self) -> str:
        """This engine's session id, ``"<host>:<rpc_port>"``."""
        ...

    @property
    def transport_ports(self) -> tuple[int, ...]:
        """The ports its data transport listens on besides the session's (empty where none is known)."""
        ...

    def register(self, regions: RegisterRegions) -> None:
        """Register memory regions (idempotent per region)."""
        ...

    def unregister(self, regions: RegisterRegions) -> None:
        """Drop one reference to each region; unregister when none is left."""
        ...


class Reader(Regions, Protocol):
    """The engine as the pull and SFA transports use it (D reads P's memory)."""

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        """Pull ``batch`` (local <- peer) from ``session``; raise `TransferError` on failure."""
        ...


class Writer(Regions, Protocol):
    """The engine as the layer-wise push uses it (P writes into D's memory)."""

    def write(self, session: str, pieces: WritePieces, *, timeout_s: float = 60.0) -> None:
        """Push ``pieces`` (local -> peer) to ``session``; raise `TransferError` on failure."""
        ...


class TransferBackend(Reader, Writer, Protocol):
    """The whole engine interface (`MooncakeEngine` implements it)."""


class MooncakeEngine:
    """A Mooncake TransferEngine over P2PHANDSHAKE with region reference counts."""

    def __init__(
        self,
        host: str,
        protocol: str = "tcp",
        device_name: str = "",
        *,
        max_pieces: int = MOONCAKE_TCP_MAX_PIECES,
        pace: TransferPace | None = None,
    ) -> None:
        """Import Mooncake, create and initialise the engine.

        ``pace`` learns how fast each peer reads (a fresh one by default).

        Raises:
            NativeLibraryError: Mooncake cannot be imported (missing wheel or libibverbs.so.1) or
                ``initialize`` failed.
        """
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise NativeLibraryError(
                "import mooncake.engine",
                -1,
                f"{exc}; install ascend-dist-kv-mooncake[cpu] and the system library libibverbs1",
            ) from exc
        self._te: Any = TransferEngine()
        before = listening_ports()
        rc = self._te.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise NativeLibraryError("TransferEngine.initialize", rc, f"host={host} protocol={protocol}")
        rpc_port = self._te.get_rpc_port()
        self._session = f"{host}:{rpc_port}"
        # Mooncake does not name its TCP transport's listener: the ports initialize() opened, less
        # the RPC port. A D that gives up a read cuts its connections to these (see tcp_sockets).
        self._transport_ports = tuple(sorted(listening_ports() - before - {rpc_port}))
        self._max_pieces = max_pieces
        self._refs: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._flight = threading.Condition()
        self._in_flight: dict[str, int] = {}
        self._pace = pace if pace is not None else TransferPace()
        logger.info("Mooncake engine %s up (protocol %s)", self._session, protocol)

    @property
    def session(self) -> str:
        """This engine's session id."""
        return self._session

    @property
    def transport_ports(self) -> tuple[int, ...]:
        """The ports Mooncake's transport opened at ``initialize`` besides the RPC port."""
        return self._transport_ports

    @property
    def pace(self) -> TransferPace:
        """What this engine learnt of each peer's read rate (how long a read sleeps before waiting)."""
        return self._pace

    @property
    def pieces_in_flight(self) -> int:
        """Pieces inside batch reads and writes that have not returned yet, to every peer.

        A read hung on a dead link stays counted until Mooncake returns it.
        """
        with self._flight:
            return sum(self._in_flight.values())

    @property
    def registered(self) -> dict[tuple[int, int], int]:
        """Registered ``(ptr, length)`` regions and their reference counts (a copy)."""
        with self._lock:
            return dict(self._refs)

    def register(self, regions: RegisterRegions) -> None:
        """Register each region not registered yet; count references to the others.

        Raises:
            RegionLimitError: More than 256 regions in this process.
            NativeLibraryError: The engine refused a region.
        """
        with self._lock:
            new = [(p, n) for p, n in zip(regions.ptrs, regions.lengths, strict=True) if (p, n) not in self._refs]
            total = len(self._refs) + len(new)
            validate_register_region_count(
                RegisterRegions(tuple(p for p, _ in [*self._refs, *new]), tuple(n for _, n in [*self._refs, *new]))
            )
            if new:
                rc = self._te.batch_register_memory([p for p, _ in new], [n for _, n in new])
                if rc != 0:
                    raise NativeLibraryError("batch_register_memory", rc, f"{len(new)} regions ({total} in all)")
            for key in zip(regions.ptrs, regions.lengths, strict=True):
                self._refs[key] = self._refs.get(key, 0) + 1

    def unregister(self, regions: RegisterRegions) -> None:
        """Drop a reference to each region; unregister those left with none."""
        with self._lock:
            for key in zip(regions.ptrs, regions.lengths, strict=True):
                left = self._refs.get(key, 0) - 1
                if left > 0:
                    self._refs[key] = left
                elif key in self._refs:
                    del self._refs[key]
                    rc = self._te.unregister_memory(key[0])
                    if rc != 0:
                        logger.warning("unregister_memory(0x%x) returned %d", key[0], rc)

    def raw_read(self, session: str, batch: Descriptors) -> int:
        """One unsplit ``batch_transfer_sync_read`` (the benchmark's baseline); returns its code."""
        return int(
            self._te.batch_transfer_sync_read(
                session, batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist()
            )
        )

    def _acquire(self, session: str, pieces: int, deadline: float) -> None:
        with self._flight:
            while self._in_flight.get(session, 0) + pieces > self._max_pieces:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"waited too long for {pieces} piece slots to {session}", peer=session)
                self._flight.wait(left)
            self._in_flight[session] = self._in_flight.get(session, 0) + pieces

    def _release(self, session: str, pieces: int) -> None:
        with self._flight:
            left = self._in_flight.get(session, 0) - pieces
            if left > 0:
                self._in_flight[session] = left
            else:
                self._in_flight.pop(session, None)
            self._flight.notify_all()

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        """Pull a batch from ``session`` in pieces of at most ``max_pieces``.

        Args:
            session: The peer's session id.
            batch: Local/peer addresses and lengths.
            timeout_s: Longest wait for piece slots to that peer (other threads' pulls).

        Raises:
            TransferError: The engine returned an error (peer gone, address not registered, timeout).
            TransferTimeout: No piece slots to the peer became free in time.
        """
        deadline = time.monotonic() + timeout_s
        for i, part in enumerate(batch.split(self._max_pieces)):
            start = time.perf_counter()
            self._acquire(session, len(part), deadline)
            try:
                rc = self._read_paced(session, part)
            finally:
                self._release(session, len(part))
            if rc < 0:
                raise TransferError(
                    f"Mooncake read returned {rc} on sub-batch {i} ({len(part)} pieces, "
                    f"{int(part.lengths.sum())} bytes) after {(time.perf_counter() - start) * 1e3:.1f} ms",
                    peer=session,
                )

    def _read_paced(self, session: str, part: Descriptors) -> int:
        """Read ``part``; when it is expected to take long enough, submit it, sleep, then wait.

        Returns Mooncake's code (0 done, negative failed). Mooncake's own transfer timeout bounds
        the wait as it bounds ``batch_transfer_sync_read``; the sleep is bounded by `TransferPace`.
        """
        nbytes = int(part.lengths.sum())
        nap = self._pace.sleep_s(session, nbytes)
        local, remote, lengths = part.local.tolist(), part.remote.tolist(), part.lengths.tolist()
        start = time.perf_counter()
        if nap <= 0:
            # Nothing to sleep through: one call, one return to the interpreter lock (which the
            # engine loop holds most of the time), where submit-then-wait takes two.
            rc = int(self._te.batch_transfer_sync_read(session, local, remote, lengths))
            if rc == 0:
                self._pace.observe(session, nbytes, time.perf_counter() - start)
            return rc
        batch_id = int(self._te.batch_transfer_async_read(session, local, remote, lengths))
        if batch_id in _NO_BATCH:
            return -1
        time.sleep(nap)
        cpu = time.thread_time()
        rc = int(self._te.get_batch_transfer_status([batch_id]))
        if rc == 0:
            # The wait spins this thread until the batch ends; one that barely spun found it done,
            # so the read took at most the sleep: that, not the time to our return, is what it
            # teaches. Our wake-up waits for the interpreter lock (up to Python's 5 ms switch
            # interval while the engine loop runs Python); taught as transfer time, every sleep
            # would outgrow the one before (measured: 35 ms sleeps before 5 ms reads).
            overslept = time.thread_time() - cpu < _DONE_AT_ONCE_S
            self._pace.observe(session, nbytes, nap if overslept else time.perf_counter() - start)
        return rc

    def raw_write(self, session: str, batch: Descriptors) -> int:
        """One unsplit ``batch_transfer_sync_write`` (the benchmark's baseline); returns its code."""
        return int(
            self._te.batch_transfer_sync_write(
                session, batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist()
            )
        )

    def write(self, session: str, pieces: WritePieces, *, timeout_s: float = 60.0) -> None:
        """Push ``(local, peer, lengths)`` lists to ``session`` in batches of at most ``max_pieces``.

        Raises:
            ConfigError: The three lists differ in length.
            TransferError: The engine returned an error (peer gone, address not registered).
            TransferTimeout: No piece slots to the peer became free in time.
        """
        local, peer, lengths = pieces
        if not len(local) == len(peer) == len(lengths):
            raise ConfigError("pieces", (len(local), len(peer), len(lengths)), "three lists of equal length")
        deadline = time.monotonic() + timeout_s
        step = self._max_pieces
        for i, start in enumerate(range(0, len(local), step)):
            end = start + step
            count = len(local[start:end])
            self._acquire(session, count, deadline)
            try:
                rc = self._te.batch_transfer_sync_write(session, local[start:end], peer[start:end], lengths[start:end])
            finally:
                self._release(session, count)
            if rc < 0:
                raise TransferError(
                    f"batch_transfer_sync_write returned {rc} on sub-batch {i} ({count} pieces, "
                    f"{sum(lengths[start:end])} bytes)",
                    peer=session,
                )


# One cache for every transport: a process running several connectors shares one engine per
# (host, protocol, device), and the region reference counts keep their registrations apart.
_ENGINES: dict[tuple[str, str, str], MooncakeEngine] = {}
_ENGINES_LOCK = threading.Lock()


def get_engine(host: str, protocol: str = "tcp", device_name: str = "") -> MooncakeEngine:
    """The process-wide engine for ``(host, protocol, device)``, created on first use.

    Raises:
        ConfigError: ``protocol`` is empty.
        NativeLibraryError: Mooncake is missing or ``initialize`` failed.
    """
    if not isinstance(protocol, str) or not protocol:
        raise ConfigError("mooncake_protocol", protocol, "tcp, rdma or ascend")
    key = (host, protocol, device_name)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = MooncakeEngine(host, protocol, device_name)
        return engine


def reset_engines_for_tests(keys: Sequence[tuple[str, str, str]] = ()) -> None:
    """Forget cached engines (the native engines live until process exit)."""
    with _ENGINES_LOCK:
        for key in keys or list(_ENGINES):
            _ENGINES.pop(key, None)
