"""The transfer engine as the adapters hand it to the workers: every batch call recorded in the connector's stats.

Runs in: vLLM's worker processes (pull, push and SFA workers call it from their transfer threads).
The transports take their engine by constructor (the `core.engine` Protocols); the adapters pass this
wrapper around the process-wide engine, so the stats see exactly what went over the wire: one
transfer per batch call (``read``: D pulls, direction ``load``; ``write``: P pushes, ``save``) with
its wall time, bytes and descriptors, or one failure classified by the error the engine raised.
Failures outside the engine (a request past its deadline, a peer that refused) are the transports'
and are recorded through `failure_sink`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from ascend_dist.common.transfer_stats import Direction, TransferStats
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import WritePieces

__all__ = ["CountingEngine"]

_RECORDED = "_ascend_dist_stats_recorded"


class CountingEngine:
    """A `Reader` / `Writer` that records each call in ``stats``; the real engine is made on first use.

    ``make_engine`` builds (or fetches) the process-wide engine; it runs once, at the first call
    (registration), so an adapter can be constructed without starting Mooncake.
    """

    def __init__(self, make_engine: Callable[[], Any], stats: TransferStats) -> None:
        """Wrap the engine ``make_engine`` returns; record into ``stats``."""
        self._make_engine = make_engine
        self._engine: Any = None
        self._lock = threading.Lock()
        self.stats = stats

    @property
    def inner(self) -> Any:
        """The wrapped engine (built now if it was not yet)."""
        with self._lock:
            if self._engine is None:
                self._engine = self._make_engine()
            return self._engine

    @property
    def session(self) -> str:
        """The wrapped engine's session id."""
        return str(self.inner.session)

    @property
    def transport_ports(self) -> tuple[int, ...]:
        """The wrapped engine's transport ports."""
        return tuple(self.inner.transport_ports)

    def register(self, regions: Any) -> None:
        """Register memory regions with the wrapped engine."""
        self.inner.register(regions)

    def unregister(self, regions: Any) -> None:
        """Drop the wrapped engine's registration of ``regions``."""
        self.inner.unregister(regions)

    def read(self, session: str, batch: Descriptors, *, timeout_s: float = 60.0) -> None:
        """The wrapped read, recorded as one ``load`` transfer (or failure)."""
        self._call("load", batch.total_bytes, len(batch), lambda: self.inner.read(session, batch, timeout_s=timeout_s))

    def write(self, session: str, pieces: WritePieces, *, timeout_s: float = 60.0) -> None:
        """The wrapped write, recorded as one ``save`` transfer (or failure)."""
        lengths = pieces[2]
        self._call("save", sum(lengths), len(lengths), lambda: self.inner.write(session, pieces, timeout_s=timeout_s))

    def _call(self, direction: Direction, nbytes: int, descriptors: int, call: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            call()
        except BaseException as exc:
            self.stats.record_failure(direction, exc)
            setattr(exc, _RECORDED, True)  # a transport's failure sink must not count it again
            raise
        self.stats.record_transfer(direction, time.perf_counter() - start, nbytes, descriptors)

    def failure_sink(self, direction: Direction = "load") -> Callable[[BaseException], None]:
        """A callback recording a transport's own failure with these stats (an engine error is counted once)."""

        def record(exc: BaseException) -> None:
            if not getattr(exc, _RECORDED, False):
                self.stats.record_failure(direction, exc)

        return record
