"""The SFA connector's choice of engine: MemFabric on Ascend, Mooncake elsewhere.

Runs in: P and D worker processes. Both engines implement the engine interface's `Reader` view
(`ascend_dist.kv_mooncake.core.engine`): `MooncakeEngine` (one per process, registration
reference counts, batches split at Mooncake TCP's 2,048-piece limit) and `MemfabricEngine`
(`ascend_dist.kv_mooncake.core.memfabric`, raises `DeviceUnavailable` without the Ascend driver).
"""

from __future__ import annotations

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.engine import Reader, get_engine
from ascend_dist.kv_mooncake.core.memfabric import get_memfabric

__all__ = ["make_backend"]


def make_backend(kind: str, host: str, *, protocol: str = "tcp", role: str = "Decode", device_id: int = 0) -> Reader:
    """The process's engine for ``transfer_backend`` (``mooncake`` or ``memfabric``).

    Raises:
        ConfigError: Unknown ``kind``.
        DeviceUnavailable: ``memfabric`` without its package or the Ascend driver.
    """
    if kind == "mooncake":
        return get_engine(host, protocol)
    if kind == "memfabric":
        return get_memfabric(host, role, device_id)
    raise ConfigError("transfer_backend", kind, "'memfabric' or 'mooncake'")
