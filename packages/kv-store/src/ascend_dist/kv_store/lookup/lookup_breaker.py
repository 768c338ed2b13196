"""The lookup client's circuit breaker: a hung lookup path costs one timeout per backoff window.

Runs in: the scheduler (inside `LookupClient`, on the scheduler's thread).

vLLM asks for every waiting request's hits synchronously, every step. A store (or rank-0 worker)
that accepts connections and never answers made each of those lookups wait out its deadline (2 x 1 s
over the RPC), so N waiting requests stalled a step for ~2N seconds. After a lookup times out the
breaker opens: lookups answer a miss at once until the backoff window ends; the next lookup is then
a probe, which closes the breaker when it is answered in time and reopens it for twice as long
(up to ``max_backoff_s``) when it times out again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ascend_dist.common.errors import ConfigError

__all__ = ["LookupBreaker"]

logger = logging.getLogger(__name__)


class LookupBreaker:
    """Closed, open until a deadline, or probing; one caller thread (the scheduler's)."""

    def __init__(
        self, *, backoff_s: float = 2.0, max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Create a closed breaker.

        Raises:
            ConfigError: A non-positive backoff, or ``max_backoff_s`` below ``backoff_s``.
        """
        if not 0 < backoff_s <= max_backoff_s:
            raise ConfigError("backoff_s", backoff_s, f"seconds in (0, max_backoff_s={max_backoff_s}]")
        self._base = backoff_s
        self._max = max_backoff_s
        self._clock = clock
        self._backoff = backoff_s
        self._open_until: float | None = None  # None: closed

    @property
    def is_open(self) -> bool:
        """Whether the last lookup let through timed out (misses are answered until a probe succeeds)."""
        return self._open_until is not None

    def allow(self) -> bool:
        """Whether a lookup may go to the server now (closed, or the backoff window has passed: a probe)."""
        return self._open_until is None or self._clock() >= self._open_until

    def timed_out(self, what: str) -> None:
        """A lookup let through missed its deadline: open (or reopen for twice as long)."""
        if self._open_until is None:
            logger.warning("KV pool lookups answer misses for %.1fs: %s", self._backoff, what)
        else:
            self._backoff = min(self._backoff * 2, self._max)
        self._open_until = self._clock() + self._backoff

    def answered(self) -> None:
        """A lookup let through was answered in time: close."""
        if self._open_until is not None:
            logger.info("KV pool lookups answered again; breaker closed")
        self._open_until = None
        self._backoff = self._base
