"""The three-method remote-read engine of the SFA connector: MemFabric on Ascend, Mooncake elsewhere.

Runs in: P and D worker processes. Upstream wraps MemFabric's engine (``GlobalMemfabricTE``)
and calls exactly three methods on it; the same three exist with the same
signatures on Mooncake's ``TransferEngine``, so the connector depends only on `RemoteReadBackend`:

* ``get_rpc_port() -> int`` (the session id peers use is ``"<host>:<port>"``),
* ``register_memory(ptr, size) -> 0 | -1``,
* ``batch_transfer_sync_read(session, local_ptrs, peer_ptrs, lengths) -> 0 | -1``.

`MooncakeReadBackend` adapts the package's engine wrapper (`ascend_dist.kv_mooncake.core.engine`: one
engine per process, registration reference counts, batches split at Mooncake TCP's 2,048-piece
limit). `MemfabricReadBackend` needs the Ascend driver; without it construction raises
`DeviceUnavailable` naming what is missing (MemFabric's ``initialize`` itself only returns -1).
Return codes are turned into typed errors by the callers (`read_or_raise`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from ascend_dist.common.descriptors import Descriptors
from ascend_dist.common.errors import ConfigError, DeviceUnavailable, NativeLibraryError, TransferError
from ascend_dist.common.regions import RegisterRegions
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, get_engine

__all__ = [
    "ASCEND_DRIVER_VERSION_FILE",
    "MemfabricReadBackend",
    "MooncakeReadBackend",
    "RemoteReadBackend",
    "make_backend",
    "read_or_raise",
    "register_all",
]

logger = logging.getLogger(__name__)

ASCEND_DRIVER_VERSION_FILE = "/usr/local/Ascend/driver/version.info"
"""MemFabric refuses to start without this file (it reads the driver version from it)."""


class RemoteReadBackend(Protocol):
    """The three calls the SFA connector makes on its engine."""

    def get_rpc_port(self) -> int:
        """The engine's RPC port; peers address it as ``"<host>:<port>"``."""
        ...

    def register_memory(self, ptr: int, size: int) -> int:
        """Register ``size`` bytes at ``ptr``; 0 on success, negative on failure."""
        ...

    def batch_transfer_sync_read(
        self, session: str, local_ptrs: list[int], peer_ptrs: list[int], lengths: list[int]
    ) -> int:
        """Read peer memory into local memory; 0 on success, negative on failure."""
        ...


def read_or_raise(backend: RemoteReadBackend, session: str, batch: Descriptors) -> None:
    """One synchronous batch read; an empty batch is a no-op.

    Raises:
        TransferError: The engine returned a nonzero code.
    """
    if len(batch) == 0:
        return
    rc = backend.batch_transfer_sync_read(session, batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist())
    if rc != 0:
        raise TransferError(
            f"batch_transfer_sync_read returned {rc} ({len(batch)} pieces, {batch.total_bytes} bytes)", peer=session
        )


class MooncakeReadBackend:
    """`RemoteReadBackend` over the package's Mooncake engine wrapper (TCP on a CPU machine)."""

    def __init__(self, engine: MooncakeEngine) -> None:
        """Wrap a (process-wide) `MooncakeEngine`."""
        self._engine = engine
        self._lock = threading.Lock()
        self._mine: list[tuple[int, int]] = []

    @property
    def engine(self) -> MooncakeEngine:
        """The wrapped engine (the benchmark issues its raw baseline reads on it)."""
        return self._engine

    @property
    def session(self) -> str:
        """This engine's session id."""
        return self._engine.session

    def get_rpc_port(self) -> int:
        """The engine's RPC port."""
        return int(self._engine.session.rsplit(":", 1)[1])

    def register_memory(self, ptr: int, size: int) -> int:
        """Register one region (reference-counted by the engine wrapper); 0 or -1."""
        try:
            self._engine.register(RegisterRegions((ptr,), (size,)))
        except (NativeLibraryError, ConfigError) as exc:
            logger.error("register_memory(0x%x, %d) failed: %s", ptr, size, exc)
            return -1
        with self._lock:
            self._mine.append((ptr, size))
        return 0

    def batch_transfer_sync_read(
        self, session: str, local_ptrs: list[int], peer_ptrs: list[int], lengths: list[int]
    ) -> int:
        """Read in sub-batches of at most 2,048 pieces; 0 or -1 (the error is logged)."""
        batch = Descriptors(
            np.asarray(local_ptrs, dtype=np.int64),
            np.asarray(peer_ptrs, dtype=np.int64),
            np.asarray(lengths, dtype=np.int64),
        )
        try:
            self._engine.read(session, batch)
        except TransferError as exc:
            logger.warning("remote read from %s failed: %s", session, exc)
            return -1
        return 0

    def release(self) -> None:
        """Drop this backend's registrations (the engine unregisters regions nobody else holds)."""
        with self._lock:
            mine, self._mine = self._mine, []
        if mine:
            self._engine.unregister(RegisterRegions(tuple(p for p, _ in mine), tuple(n for _, n in mine)))


class MemfabricReadBackend:
    """`RemoteReadBackend` over MemFabric (``memfabric_hybrid``); Ascend only."""

    def __init__(self, hostname: str, role: str, device_id: int) -> None:
        """Create and initialise MemFabric's engine.

        Raises:
            ConfigError: ``role`` is not ``Prefill``/``Decode`` or ``device_id`` is negative.
            DeviceUnavailable: ``memfabric_hybrid`` is not installed or the Ascend driver is missing.
            NativeLibraryError: ``initialize`` returned an error.
        """
        if role not in ("Prefill", "Decode"):
            raise ConfigError("role", role, "'Prefill' or 'Decode'")
        if device_id < 0:
            raise ConfigError("device_id", device_id, "an int >= 0")
        if importlib.util.find_spec("memfabric_hybrid") is None:
            raise DeviceUnavailable(
                "transfer_backend='memfabric' needs the memfabric_hybrid package (pip install memfabric-hybrid) "
                "and the Ascend driver; on other machines set transfer_backend='mooncake'"
            )
        if not os.path.isfile(ASCEND_DRIVER_VERSION_FILE):
            raise DeviceUnavailable(
                f"transfer_backend='memfabric' needs the Ascend driver ({ASCEND_DRIVER_VERSION_FILE} is missing); "
                "on a machine without Ascend NPUs set transfer_backend='mooncake'"
            )
        # Imported by name: an Ascend-only wheel, not a dependency of this package (install it with the driver).
        mf: Any = importlib.import_module("memfabric_hybrid")
        mf.set_log_level(2)
        mf.set_conf_store_tls(False, "")
        self._te: Any = mf.TransferEngine()
        rc = self._te.initialize(f"tcp://{hostname}", hostname, role, device_id, store_server_role="Prefill")
        if rc != 0:
            raise NativeLibraryError("memfabric TransferEngine.initialize", rc, f"host={hostname} role={role}")

    def get_rpc_port(self) -> int:
        """MemFabric's RPC port."""
        return int(self._te.get_rpc_port())

    def register_memory(self, ptr: int, size: int) -> int:
        """Register device or host memory; 0 or -1."""
        return int(self._te.register_memory(ptr, size))

    def batch_transfer_sync_read(
        self, session: str, local_ptrs: list[int], peer_ptrs: list[int], lengths: list[int]
    ) -> int:
        """One-sided read from the peer's memory; 0 or -1."""
        return int(self._te.batch_transfer_sync_read(session, local_ptrs, peer_ptrs, lengths))


_MEMFABRIC: dict[str, tuple[tuple[str, str, int], MemfabricReadBackend]] = {}
_MEMFABRIC_LOCK = threading.Lock()


def _memfabric(host: str, role: str, device_id: int) -> MemfabricReadBackend:
    """The process's one MemFabric engine; asking again with other settings is an error."""
    with _MEMFABRIC_LOCK:
        known = _MEMFABRIC.get("engine")
        if known is not None:
            if known[0] != (host, role, device_id):
                raise ConfigError("memfabric engine", (host, role, device_id), f"the process's settings {known[0]}")
            return known[1]
        engine = MemfabricReadBackend(host, role, device_id)
        _MEMFABRIC["engine"] = ((host, role, device_id), engine)
        return engine


def make_backend(
    kind: str, host: str, *, protocol: str = "tcp", role: str = "Decode", device_id: int = 0
) -> RemoteReadBackend:
    """The process's backend for ``transfer_backend`` (``mooncake`` or ``memfabric``).

    Raises:
        ConfigError: Unknown ``kind``.
        DeviceUnavailable: ``memfabric`` without its package or the Ascend driver.
    """
    if kind == "mooncake":
        return MooncakeReadBackend(get_engine(host, protocol))
    if kind == "memfabric":
        return _memfabric(host, role, device_id)
    raise ConfigError("transfer_backend", kind, "'memfabric' or 'mooncake'")


def register_all(backend: RemoteReadBackend, regions: Sequence[tuple[int, int]]) -> None:
    """Register each ``(ptr, size)``.

    Raises:
        NativeLibraryError: The backend refused a region.
    """
    for ptr, size in regions:
        rc = backend.register_memory(ptr, size)
        if rc != 0:
            raise NativeLibraryError("register_memory", rc, f"ptr=0x{ptr:x} size={size}")
