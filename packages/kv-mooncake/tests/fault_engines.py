"""Fault injection around a real transfer engine, for kv-mooncake's tests: wrappers of our engine interface.

A fault test hands a connector one of these instead of the real engine (through its constructor):
`EngineWrapper` forwards every call (``session``, ``transport_ports``, ``register``, ``unregister``,
``read``, ``write``) to the real engine, so a subclass overrides only the call it breaks (a read that hangs, arrives
late, or outlasts a lease; a write that lags). Nothing here imports an engine: the wrapped object
is whatever engine the test built.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["CountingReader", "CountingWriter", "EngineWrapper", "SlowWriter"]


class EngineWrapper:
    """Forwards every engine call to ``real``."""

    def __init__(self, real: Any) -> None:
        """Wrap ``real`` (the engine the test built)."""
        self.real = real

    @property
    def session(self) -> str:
        """The real engine's session id."""
        return str(self.real.session)

    @property
    def transport_ports(self) -> tuple[int, ...]:
        """The real engine's transport ports."""
        return tuple(self.real.transport_ports)

    def register(self, regions: Any) -> None:
        """Register with the real engine."""
        self.real.register(regions)

    def unregister(self, regions: Any) -> None:
        """Unregister from the real engine."""
        self.real.unregister(regions)

    def read(self, session: str, batch: Any, *, timeout_s: float = 60.0) -> None:
        """The real engine's read."""
        self.real.read(session, batch, timeout_s=timeout_s)

    def write(self, session: str, pieces: Any, *, timeout_s: float = 60.0) -> None:
        """The real engine's write."""
        self.real.write(session, pieces, timeout_s=timeout_s)


class CountingReader(EngineWrapper):
    """Counts the reads issued (a refused request must reach none)."""

    def __init__(self, real: Any) -> None:
        """Wrap ``real``; no read yet."""
        super().__init__(real)
        self.reads = 0

    def read(self, session: str, batch: Any, *, timeout_s: float = 60.0) -> None:
        """Count, then read."""
        self.reads += 1
        super().read(session, batch, timeout_s=timeout_s)


class CountingWriter(EngineWrapper):
    """Counts the writes issued (a refused push must reach none)."""

    def __init__(self, real: Any) -> None:
        """Wrap ``real``; no write yet."""
        super().__init__(real)
        self.writes = 0

    def write(self, session: str, pieces: Any, *, timeout_s: float = 60.0) -> None:
        """Count, then write."""
        self.writes += 1
        super().write(session, pieces, timeout_s=timeout_s)


class SlowWriter(EngineWrapper):
    """Every write starts ``delay_s`` late (a push lagging far behind the forward)."""

    def __init__(self, real: Any, delay_s: float) -> None:
        """Wrap ``real``; each write waits ``delay_s`` first."""
        super().__init__(real)
        self.delay_s = delay_s

    def write(self, session: str, pieces: Any, *, timeout_s: float = 60.0) -> None:
        """Wait ``delay_s``, then write."""
        time.sleep(self.delay_s)
        super().write(session, pieces, timeout_s=timeout_s)
