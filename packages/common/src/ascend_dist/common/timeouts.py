"""Transfer-timeout derivation and a small deadline object over an injectable monotonic clock.

Runs in: worker processes (the timeout is exported before the transfer engine starts) and any code
that bounds a wait. Pure apart from reading/writing the environment mapping it is given.

The transfer timeout follows vllm-ascend ``distributed/kv_transfer/utils/utils.py``
(``get_transfer_timeout_value``, v0.11): ``ASCEND_TRANSFER_TIMEOUT`` in ms if set, else the HCCL
RDMA retransmission budget ``4.096 us * 2**HCCL_RDMA_TIMEOUT * HCCL_RDMA_RETRY_CNT`` plus 3 s of
slack. With HCCL's defaults (20, 7) that is 33 064 ms, the "33.06 s" seen in Mooncake timeout logs.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Final

from ascend_dist.common.errors import ConfigError, DeadlineExceeded

__all__ = [
    "ASCEND_TRANSFER_TIMEOUT",
    "DEFAULT_HCCL_RDMA_RETRY_CNT",
    "DEFAULT_HCCL_RDMA_TIMEOUT",
    "HCCL_RDMA_RETRY_CNT",
    "HCCL_RDMA_TIMEOUT",
    "Deadline",
    "export_transfer_timeout",
    "transfer_timeout_ms",
]

ASCEND_TRANSFER_TIMEOUT: Final = "ASCEND_TRANSFER_TIMEOUT"
HCCL_RDMA_TIMEOUT: Final = "HCCL_RDMA_TIMEOUT"
HCCL_RDMA_RETRY_CNT: Final = "HCCL_RDMA_RETRY_CNT"
DEFAULT_HCCL_RDMA_TIMEOUT: Final = 20
DEFAULT_HCCL_RDMA_RETRY_CNT: Final = 7

# The exponent is bounded so a typo cannot turn into a timeout of centuries (2**63 * 4 us).
_MAX_RDMA_TIMEOUT_EXPONENT: Final = 31


def _env_int(env: Mapping[str, str], name: str, default: int, low: int, high: int | None) -> int:
    """Read a decimal integer env var within ``[low, high]``; unset or empty -> ``default``."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    bound = f"a decimal integer >= {low}" if high is None else f"a decimal integer in [{low}, {high}]"
    # isascii/isdigit rather than bare int(): int() also takes "1_000", "+5" and non-ASCII digits.
    if not (raw.isascii() and raw.isdigit()):
        raise ConfigError(name, raw, bound)
    value = int(raw)
    if value < low or (high is not None and value > high):
        raise ConfigError(name, raw, bound)
    return value


def transfer_timeout_ms(env: Mapping[str, str] | None = None) -> int:
    """Return the per-batch transfer timeout in milliseconds.

    Args:
        env: Environment to read; ``os.environ`` when ``None``.

    Returns:
        ``ASCEND_TRANSFER_TIMEOUT`` if set and non-empty, else
        ``int(4.096 * 2**HCCL_RDMA_TIMEOUT * HCCL_RDMA_RETRY_CNT // 1000 + 3000)`` with defaults
        20 and 7 (-> 33064).

    Raises:
        ConfigError: One of the three variables is not an integer in its allowed range
            (``ASCEND_TRANSFER_TIMEOUT >= 1``, ``0 <= HCCL_RDMA_TIMEOUT <= 31``,
            ``HCCL_RDMA_RETRY_CNT >= 0``); the message names the variable.
    """
    source = os.environ if env is None else env
    if source.get(ASCEND_TRANSFER_TIMEOUT, "").strip():
        return _env_int(source, ASCEND_TRANSFER_TIMEOUT, 0, 1, None)
    exponent = _env_int(source, HCCL_RDMA_TIMEOUT, DEFAULT_HCCL_RDMA_TIMEOUT, 0, _MAX_RDMA_TIMEOUT_EXPONENT)
    retries = _env_int(source, HCCL_RDMA_RETRY_CNT, DEFAULT_HCCL_RDMA_RETRY_CNT, 0, None)
    # Same float expression as upstream so both sides of a P/D pair derive the identical number.
    return int((4.096 * (2**exponent)) * retries // 1000 + 3000)


def export_transfer_timeout(env: MutableMapping[str, str]) -> int:
    """Compute the transfer timeout and store it as ``ASCEND_TRANSFER_TIMEOUT`` in ``env``.

    Workers call this before the transfer engine starts so the engine and this process agree.

    Args:
        env: The environment to read and update (usually ``os.environ``).

    Returns:
        The timeout in milliseconds that was exported.

    Raises:
        ConfigError: As for `transfer_timeout_ms`.
    """
    value = transfer_timeout_ms(env)
    env[ASCEND_TRANSFER_TIMEOUT] = str(value)
    return value


class Deadline:
    """A point in time on a monotonic clock, after which a bounded wait must give up.

    The clock is injected (``time.monotonic`` by default) so tests step it by hand instead of
    sleeping. Deadlines are process-local: never send one to another process.
    """

    __slots__ = ("_clock", "_expires_at")

    def __init__(self, expires_at: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        """Create a deadline at an absolute clock reading; prefer `Deadline.after`."""
        self._expires_at = expires_at
        self._clock = clock

    @classmethod
    def after(cls, seconds: float, *, clock: Callable[[], float] = time.monotonic) -> Deadline:
        """Return a deadline ``seconds`` from now on ``clock``.

        Args:
            seconds: Time budget, finite and ``>= 0``.
            clock: Monotonic clock returning seconds.

        Returns:
            The new deadline.

        Raises:
            ConfigError: ``seconds`` is negative, NaN or infinite (nothing may wait forever).
        """
        if isinstance(seconds, bool) or not math.isfinite(seconds) or seconds < 0:
            raise ConfigError("seconds", seconds, "a finite number of seconds >= 0")
        return cls(clock() + seconds, clock=clock)

    @property
    def expires_at(self) -> float:
        """The clock reading at which the deadline expires."""
        return self._expires_at

    def remaining(self) -> float:
        """Seconds left, never negative (``0.0`` once expired)."""
        return max(0.0, self._expires_at - self._clock())

    def expired(self) -> bool:
        """Whether the deadline has passed (a deadline of 0 s is expired at once)."""
        return self._clock() >= self._expires_at

    def check(self, what: str) -> None:
        """Raise if the deadline has passed.

        Args:
            what: The operation being bounded, for the error message.

        Raises:
            DeadlineExceeded: The deadline has passed; the message names ``what``.
        """
        now = self._clock()
        if now >= self._expires_at:
            raise DeadlineExceeded(f"{what}: deadline exceeded by {now - self._expires_at:.3f}s")

    def __repr__(self) -> str:
        return f"Deadline(remaining={self.remaining():.3f}s)"
