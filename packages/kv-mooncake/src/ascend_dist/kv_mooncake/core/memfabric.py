"""MemFabric (``memfabric_hybrid``) behind the engine interface's `Reader` view; Ascend only.

Runs in: SFA P and D worker processes. Upstream wraps MemFabric's engine (``GlobalMemfabricTE``)
and calls three of its methods: ``get_rpc_port``, ``register_memory`` and
``batch_transfer_sync_read``. `MemfabricEngine` turns them into `Reader`'s session address,
region registration and typed-error reads, so the SFA transport sees the same interface as with
Mooncake. Without the package or the Ascend driver, construction raises `DeviceUnavailable`
naming what is missing (MemFabric's own ``initialize`` only returns -1). One engine per process.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from typing import Any

from ascend_dist.common.errors import ConfigError, DeviceUnavailable, NativeLibraryError, TransferError
from ascend_dist.common.regions import RegisterRegions
from ascend_dist.kv_mooncake.core.descriptors import Descriptors

__all__ = ["ASCEND_DRIVER_VERSION_FILE", "MemfabricEngine", "get_memfabric"]

ASCEND_DRIVER_VERSION_FILE = "/usr/local/Ascend/driver/version.info"
"""MemFabric refuses to start without this file (it reads the driver version from it)."""


class MemfabricEngine:
    """A `Reader` over MemFabric's transfer engine."""

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
        self._session = f"{hostname}:{int(self._te.get_rpc_port())}"

    @property
    def session(self) -> str:
        """``"<host>:<rpc_port>"``, the address peers read from."""
        return self._session

    @property
    def transport_ports(self) -> tuple[int, ...]:
        """None known: MemFabric moves bytes over the device fabric, not over TCP connections of ours."""
        return ()

    def register(self, regions: RegisterRegions) -> None:
        """Register each region (device or host memory).

        Raises:
            NativeLibraryError: MemFabric refused a region.
        """
        for ptr, size in zip(regions.ptrs, regions.lengths, strict=True):
            rc = int(self._te.register_memory(ptr, size))
            if rc != 0:
                raise NativeLibraryError("register_memory", rc, f"ptr=0x{ptr:x} size={size}")

    def unregister(self, regions: RegisterRegions) -> None:
        """Nothing: MemFabric's registrations last as long as its process-wide engine (as upstream)."""

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        """One-sided read of ``batch`` from ``session`` (MemFabric has no piece cap or slot wait).

        Raises:
            TransferError: MemFabric returned a nonzero code.
        """
        if len(batch) == 0:
            return
        rc = int(
            self._te.batch_transfer_sync_read(
                session, batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist()
            )
        )
        if rc != 0:
            raise TransferError(
                f"batch_transfer_sync_read returned {rc} ({len(batch)} pieces, {batch.total_bytes} bytes)",
                peer=session,
            )


_ENGINE: list[tuple[tuple[str, str, int], MemfabricEngine]] = []
_LOCK = threading.Lock()


def get_memfabric(host: str, role: str, device_id: int) -> MemfabricEngine:
    """The process's one MemFabric engine; asking again with other settings is an error.

    Raises:
        ConfigError: The process's engine was made with other settings (or bad ones, see `MemfabricEngine`).
        DeviceUnavailable: No ``memfabric_hybrid`` or no Ascend driver.
    """
    with _LOCK:
        if _ENGINE:
            settings, engine = _ENGINE[0]
            if settings != (host, role, device_id):
                raise ConfigError("memfabric engine", (host, role, device_id), f"the process's settings {settings}")
            return engine
        engine = MemfabricEngine(host, role, device_id)
        _ENGINE.append(((host, role, device_id), engine))
        return engine
