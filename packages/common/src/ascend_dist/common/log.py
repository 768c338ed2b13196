"""Log a message once per (logger, key), or once per interval with a count, so no input floods the log.

Runs in: any process. `log_once` is the equivalent of vLLM's ``warning_once``/``info_once``, but
keyed explicitly and with bounded memory: remembered keys live in an LRU of fixed size (4096 by
default), so a key evicted by many newer ones may be logged once more. `IntervalLog` is for errors
a peer can repeat at will (junk frames, refused requests): the first of a kind is logged, the rest
of the interval only counted, and the next line says how many were suppressed. This module never
configures handlers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Final

from ascend_dist.common.errors import ConfigError

__all__ = ["DEFAULT_LOG_ONCE_CAPACITY", "IntervalLog", "OnceRegistry", "log_once"]

DEFAULT_LOG_ONCE_CAPACITY: Final = 4096


class OnceRegistry:
    """Remembers which (logger name, key) pairs have been logged; thread-safe, LRU-bounded."""

    def __init__(self, capacity: int = DEFAULT_LOG_ONCE_CAPACITY) -> None:
        """Create a registry remembering at most ``capacity`` keys.

        Raises:
            ConfigError: ``capacity`` is not a positive integer.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError("capacity", capacity, "a positive integer")
        self._capacity = capacity
        self._seen: OrderedDict[tuple[str, Hashable], None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def first_time(self, logger_name: str, key: Hashable) -> bool:
        """Record ``key`` for ``logger_name``; return True if it was not remembered before."""
        entry = (logger_name, key)
        with self._lock:
            if entry in self._seen:
                self._seen.move_to_end(entry)  # keep hot keys from being evicted
                return False
            self._seen[entry] = None
            if len(self._seen) > self._capacity:
                self._seen.popitem(last=False)
            return True

    def log(
        self,
        logger: logging.Logger,
        level: int,
        msg: str,
        *args: object,
        key: Hashable | None = None,
        stacklevel: int = 1,
    ) -> bool:
        """Log ``msg % args`` the first time this (logger, key) is seen; see `log_once`."""
        # A disabled level records nothing, so enabling it later still shows the message once.
        if not logger.isEnabledFor(level):
            return False
        if not self.first_time(logger.name, msg if key is None else key):
            return False
        logger.log(level, msg, *args, stacklevel=stacklevel + 1)
        return True


_REGISTRY: Final = OnceRegistry()


def log_once(logger: logging.Logger, level: int, msg: str, *args: object, key: Hashable | None = None) -> bool:
    """Log a message only the first time it is seen for this logger.

    Args:
        logger: The module's logger.
        level: A `logging` level such as ``logging.WARNING``.
        msg: %-style format string (arguments are formatted lazily, as with `logging`).
        *args: Arguments for ``msg``.
        key: What "the same message" means; defaults to ``msg`` itself (not the formatted text),
            so ``log_once(log, WARNING, "slow peer %s", host)`` logs once whatever ``host`` is.
            Pass e.g. ``key=("slow peer", host)`` to log once per host.

    Returns:
        True if the message was emitted now; False if it was seen before (or the level is
        disabled on ``logger``, in which case nothing is remembered).
    """
    return _REGISTRY.log(logger, level, msg, *args, key=key, stacklevel=2)


class IntervalLog:
    """Logs each kind of message at most once per interval, then how many were suppressed.

    Thread-safe; remembers at most ``capacity`` kinds (LRU), so a peer inventing new kinds costs
    bounded memory (an evicted kind may be logged once more).

    Example:
        >>> limiter = IntervalLog(interval_s=10.0)
        >>> limiter.log(logging.getLogger("x"), logging.WARNING, "bad frame", "dropped a bad frame from %s", "peer")
        True
    """

    def __init__(
        self, interval_s: float = 10.0, *, capacity: int = 1024, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Create a limiter.

        Raises:
            ConfigError: ``interval_s`` is not positive or ``capacity`` not a positive integer.
        """
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) or not interval_s > 0:
            raise ConfigError("interval_s", interval_s, "a positive number of seconds")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError("capacity", capacity, "a positive integer")
        self._interval = float(interval_s)
        self._capacity = capacity
        self._clock = clock
        self._kinds: OrderedDict[Hashable, list[float]] = OrderedDict()  # kind -> [next emit time, suppressed]
        self._lock = threading.Lock()

    def suppressed(self, kind: Hashable) -> int:
        """How many messages of ``kind`` were counted but not logged since its last line."""
        with self._lock:
            entry = self._kinds.get(kind)
            return int(entry[1]) if entry is not None else 0

    def log(
        self,
        logger: logging.Logger,
        level: int,
        kind: Hashable,
        msg: str,
        *args: object,
        exc_info: BaseException | None = None,
    ) -> bool:
        """Log ``msg % args`` unless ``kind`` was logged less than one interval ago (then count it).

        A line after suppressed ones ends with ``[N more like this in the last S s]``. ``exc_info``
        attaches a traceback to the emitted line only.

        Returns:
            Whether a line was emitted now.
        """
        if not logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            entry = self._kinds.get(kind)
            if entry is not None and now < entry[0]:
                entry[1] += 1
                self._kinds.move_to_end(kind)
                return False
            suppressed = int(entry[1]) if entry is not None else 0
            self._kinds[kind] = [now + self._interval, 0]
            self._kinds.move_to_end(kind)
            if len(self._kinds) > self._capacity:
                self._kinds.popitem(last=False)
        if suppressed:
            msg += " [%d more like this in the last %.0f s]"
            args = (*args, suppressed, self._interval)
        logger.log(level, msg, *args, exc_info=exc_info, stacklevel=2)
        return True
