"""The device fence between a layer's KV write and the thread that sends those bytes.

Runs in: P worker processes (layer-wise push, SFA). On an NPU or GPU the layer's KV write is a
kernel queued on the compute stream: when ``save_kv_layer`` returns, the bytes may not be in
memory yet, so the send thread must wait for an event recorded after the write. On the CPU
simulation the write already happened on the calling thread (no fence).
"""

from __future__ import annotations

from collections.abc import Callable

from ascend_dist.common.device import get_runtime

__all__ = ["Fence", "write_fence"]

# Called on the compute thread after the write was enqueued; returns the wait for the send thread
# (raises `DeadlineExceeded` past its timeout), or None when nothing needs waiting for.
Fence = Callable[[], Callable[[], None] | None]


def write_fence(device_index: int, timeout_s: float) -> Callable[[], None] | None:
    """An event on ``device_index``'s current stream now, and its bounded wait; None on the CPU."""
    runtime = get_runtime(device_index)
    if runtime.name == "cpu":
        return None
    event = runtime.current_stream().record_event()
    return lambda: event.synchronize(timeout=timeout_s)
