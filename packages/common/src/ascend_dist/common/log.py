"""Log a message once per (logger, key), for per-step code paths that would otherwise flood the log.

Runs in: any process. The equivalent of vLLM's ``warning_once``/``info_once``, but keyed explicitly
and with bounded memory: remembered keys live in an LRU of fixed size (4096 by default), so a key
evicted by many newer ones may be logged once more. This module never configures handlers.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Final

from ascend_dist.common.errors import ConfigError

__all__ = ["DEFAULT_LOG_ONCE_CAPACITY", "OnceRegistry", "log_once"]

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
