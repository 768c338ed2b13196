"""Attention-compute start gate: start a prefetch copy when attention starts.

Runs in: worker processes. A gate is armed once per layer; the attention backend calls `record`
right before launching its kernel (with the device event of that point, or None on CPU), and load
tasks wait on it with a deadline. Process-global current gate, guarded by a lock.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["AttentionStartGate", "current_gate", "reset_gate"]


class _Event(Protocol):
    def synchronize(self) -> None: ...


class AttentionStartGate:
    """Set once attention started; the first record wins."""

    def __init__(self) -> None:
        """Create an unset gate."""
        self._event = threading.Event()
        self._device_event: _Event | None = None
        self._lock = threading.Lock()

    def record(self, device_event: _Event | None = None) -> None:
        """Attention is about to start (only the first call counts)."""
        with self._lock:
            if self._event.is_set():
                return
            self._device_event = device_event
            self._event.set()

    def wait(self, timeout_s: float = 10.0) -> bool:
        """Wait for `record`, then for its device event; False on timeout (callers log and retry)."""
        if not self._event.wait(timeout_s):
            return False
        if self._device_event is not None:
            self._device_event.synchronize()
        return True


_lock = threading.Lock()
_holder: list[AttentionStartGate] = [AttentionStartGate()]


def reset_gate() -> AttentionStartGate:
    """Install and return a fresh gate (at each step and each ``wait_for_layer_load``)."""
    with _lock:
        _holder[0] = AttentionStartGate()
        return _holder[0]


def current_gate() -> AttentionStartGate:
    """The gate load tasks capture at submission."""
    with _lock:
        return _holder[0]
