"""The Mooncake engine with the push direction (``batch_transfer_sync_write``).

Runs in: P worker processes. `PushEngine` extends the pull connector's `MooncakeEngine` (region
reference counts, per-peer piece cap, 2,048-piece batches) with `write`; one per process and
``(host, protocol, device)``, like `ascend_dist.kv_mooncake.core.engine.get_engine`. A process running
both connectors has two engines (allowed by Mooncake; each registers what its connector uses).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

from ascend_dist.common.descriptors import Descriptors
from ascend_dist.common.errors import ConfigError, TransferError
from ascend_dist.common.regions import RegisterRegions
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine
from ascend_dist.kv_mooncake.push.plan import Pieces

__all__ = ["PushBackend", "PushEngine", "get_push_engine"]


class PushBackend(Protocol):
    """What the layer-wise connector needs from a transfer engine."""

    @property
    def session(self) -> str:
        """This engine's session id, ``"<host>:<rpc_port>"``."""
        ...

    def register(self, regions: RegisterRegions) -> None:
        """Register memory regions (idempotent per region)."""
        ...

    def unregister(self, regions: RegisterRegions) -> None:
        """Drop one reference to each region."""
        ...

    def write(self, session: str, pieces: Pieces, *, timeout_s: float = 60.0) -> None:
        """Push ``pieces`` (local -> peer) to ``session``; raise `TransferError` on failure."""
        ...


class PushEngine(MooncakeEngine):
    """`MooncakeEngine` plus the write direction."""

    def raw_write(self, session: str, batch: Descriptors) -> int:
        """One unsplit ``batch_transfer_sync_write`` (the benchmark's baseline); returns its code."""
        return int(
            self._te.batch_transfer_sync_write(
                session, batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist()
            )
        )

    def write(self, session: str, pieces: Pieces, *, timeout_s: float = 60.0) -> None:
        """Push ``(local, peer, lengths)`` lists to ``session`` in batches of at most ``max_pieces``.

        Raises:
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


_ENGINES: dict[tuple[str, str, str], PushEngine] = {}
_LOCK = threading.Lock()


def get_push_engine(host: str, protocol: str = "tcp", device_name: str = "") -> PushEngine:
    """The process-wide push engine for ``(host, protocol, device)``, created on first use.

    Raises:
        ConfigError: ``protocol`` is empty.
        NativeLibraryError: Mooncake is missing or ``initialize`` failed.
    """
    if not isinstance(protocol, str) or not protocol:
        raise ConfigError("mooncake_protocol", protocol, "tcp, rdma or ascend")
    key = (host, protocol, device_name)
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = PushEngine(host, protocol, device_name)
        return engine
