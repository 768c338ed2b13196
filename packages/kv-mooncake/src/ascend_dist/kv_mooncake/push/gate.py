"""The layer-wise buffer reuse gate of a P worker.

Runs in: P worker processes: the forward thread closes a layer's gate (`mark_pending`) before its
send task becomes visible and waits on it at the layer's next entry (`wait_for_layer_reuse`); the
send thread opens it (`complete`) once the layer's writes to D are done, failed or not.

P frees a request's blocks when the request ends on P, while its last layers may still be in
flight to D; the next forward could overwrite that storage before the engine read it. The gate is
keyed by *storage slot* (each distinct tensor base address), so layers sharing storage share a gate.
Upstream only waits on it when composed with a store connector; here the producer's own
``wait_for_layer_load`` waits (cheap when nothing is pending). That per-layer wait alone is not
enough under vLLM: its forward writes a layer's KV (``unified_kv_cache_update``) BEFORE calling
``wait_for_layer_load``, so the producer also waits for every slot (`wait_all`) when a step starts,
before any of the step's writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, TransferError

__all__ = ["ReuseGate"]

logger = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0


class ReuseGate:
    """One event per storage slot; a layer is reusable when all its slots' events are set."""

    def __init__(self, slots_by_layer: Mapping[int, Sequence[int]], *, alive: Callable[[], bool]) -> None:
        """Create the gate with every slot open.

        Args:
            slots_by_layer: Layer index -> the storage slots (tensor base addresses) it writes.
            alive: Whether the send thread still runs (a dead thread fails every wait).
        """
        self._slots = {layer: tuple(sorted(set(slots))) for layer, slots in slots_by_layer.items()}
        self._events: dict[int, threading.Event] = {}
        for slots in self._slots.values():
            for slot in slots:
                ev = self._events.setdefault(slot, threading.Event())
                ev.set()
        self._errors: dict[int, str] = {}
        self._lock = threading.Lock()
        self._alive = alive

    def _layer_slots(self, layer: int) -> tuple[int, ...]:
        slots = self._slots.get(layer)
        if slots is None:
            raise ConfigError("layer", layer, f"a registered layer index in [0, {len(self._slots)})")
        return slots

    def mark_pending(self, layer: int) -> None:
        """Close the layer's slots (and clear their last error) before its send task is queued."""
        with self._lock:
            for slot in self._layer_slots(layer):
                self._events[slot].clear()
                self._errors.pop(slot, None)

    def complete(self, layer: int, error: str | None = None) -> None:
        """The send thread finished the layer's task: record ``error`` (if any) and open its slots."""
        with self._lock:
            for slot in self._layer_slots(layer):
                if error:
                    self._errors[slot] = error
                self._events[slot].set()

    def pending(self, layer: int) -> bool:
        """Whether any slot of the layer is still closed."""
        return any(not self._events[s].is_set() for s in self._layer_slots(layer))

    def wait_for_layer_reuse(self, layer: int, timeout_s: float) -> str | None:
        """Block until the layer's storage may be overwritten.

        Args:
            layer: Layer index.
            timeout_s: Longest wait.

        Returns:
            The error recorded by the last push of the layer (already reported to D as a failed
            request, so the caller only logs it), or None.

        Raises:
            TransferError: The send thread died while the layer was pending.
            DeadlineExceeded: The layer stayed pending for ``timeout_s``.
        """
        self._wait_slots(self._layer_slots(layer), time.monotonic() + timeout_s, timeout_s, f"layer {layer}")
        with self._lock:
            errors = {self._errors[s] for s in self._layer_slots(layer) if s in self._errors}
        return "; ".join(sorted(errors)) or None

    def wait_all(self, timeout_s: float) -> None:
        """Block until every layer's storage may be overwritten (no push of any layer pending).

        Raises:
            TransferError: The send thread died while a layer was pending.
            DeadlineExceeded: Some layer stayed pending for ``timeout_s``.
        """
        slots = tuple(sorted({s for layer_slots in self._slots.values() for s in layer_slots}))
        self._wait_slots(slots, time.monotonic() + timeout_s, timeout_s, "a queued layer")

    def _wait_slots(self, slots: Sequence[int], deadline: float, timeout_s: float, what: str) -> None:
        next_log = time.monotonic() + _LOG_EVERY_S
        for slot in slots:
            ev = self._events[slot]
            while not ev.wait(0.05):
                if not self._alive():
                    raise TransferError(f"send thread stopped while {what} was pending")
                now = time.monotonic()
                if now >= deadline:
                    raise DeadlineExceeded(f"{what} still being pushed after {timeout_s} s")
                if now >= next_log:
                    logger.warning("%s: waiting for its previous push before reusing its storage", what)
                    next_log = now + _LOG_EVERY_S
