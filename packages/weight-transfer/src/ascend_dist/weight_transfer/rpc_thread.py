"""Run an engine RPC beside the trainer's own side of a collective: both bounded, both errors kept.

Runs in: the trainer process (the vLLM trainer adapters).

The broadcast trainer and vLLM's workers meet inside the same collectives, so the client's RPC
(``init_weight_transfer_engine``, ``update_weights``) runs while the trainer connects or
broadcasts. Both run on threads here and the caller waits for the first decisive outcome:

- the RPC fails first: the trainer's side gets a short grace (`LOCAL_GRACE_S`) to fail too (its
  error, caused by the RPC's, is raised then); else the RPC's error is raised as the cause of
  `EngineRpcFailed`, and the trainer's side is abandoned: it ends by its own deadline, releasing
  what it built (``discard``);
- the trainer's side fails: the RPC gets a short grace to answer, and its error, when it has one,
  becomes the cause of the trainer's error (the server's refusal usually explains the timeout);
- the trainer's side succeeds: the RPC must answer within ``timeout_s``, else `DeadlineExceeded`.

A call stuck inside the client cannot be interrupted: its thread is a daemon and is named in the error.
The trainer's side runs on a thread that is not a daemon: it bounds its own waits, so a process that
exits while an abandoned one still waits (a rendezvous no engine will join: up to the group's
``init_timeout_s``) waits for it at exit. As a daemon it was left inside torch's store wait while the
interpreter tore down, and the process aborted (``terminate called without an active exception``).

`bounded_rpc` is the same deadline for an RPC with nothing beside it (the ``npu_ipc`` control plane):
its own error is raised unchanged, and a call that does not return in time is a `DeadlineExceeded`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from ascend_dist.common.device import current_device_index, set_current_device
from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.weight_transfer.errors import EngineRpcFailed

__all__ = ["LOCAL_GRACE_S", "RPC_GRACE_S", "beside_rpc", "bounded_rpc"]

T = TypeVar("T")

RPC_GRACE_S = 10.0
"""How long, after the trainer's side failed, to wait for the RPC's own answer (its error is the cause)."""


LOCAL_GRACE_S = 5.0
"""How long, after the RPC failed, the trainer's side may take to fail too (its error is then raised)."""


class _Call(Generic[T]):
    """``fn`` on a thread (a daemon unless it bounds its own waits); ``changed`` is notified when it ends."""

    def __init__(
        self, name: str, fn: Callable[[], T], changed: threading.Condition, device: int | None, *, daemon: bool = True
    ) -> None:
        self.result: T | None = None
        self.error: BaseException | None = None
        self.done = False
        self._discard: Callable[[T], object] | None = None
        self._fn = fn
        self._changed = changed
        self._device = device
        self.thread = threading.Thread(target=self._run, name=name, daemon=daemon)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self._device is not None:  # torch's current device is per thread: keep the caller's
                set_current_device(self._device)
            result = self._fn()
        except BaseException as exc:  # handed to the caller's thread
            with self._changed:
                self.error, self.done = exc, True
                self._changed.notify_all()
            return
        with self._changed:
            self.result, self.done = result, True
            discard = self._discard
            self._changed.notify_all()
        if discard is not None:
            discard(result)  # abandoned: nobody will use what it built

    def abandon(self, discard: Callable[[T], object] | None) -> None:
        """Nobody waits for this call any more: ``discard`` its result if it still succeeds."""
        with self._changed:
            if not self.done:
                self._discard = discard
                return
            result = self.result if self.error is None else None
        if discard is not None and result is not None:
            discard(result)


def beside_rpc(
    what: str,
    rpc: Callable[[], object],
    local: Callable[[], T],
    *,
    timeout_s: float,
    local_timeout_s: float,
    discard: Callable[[T], object] | None = None,
) -> T:
    """Run ``rpc`` and ``local`` on threads; return ``local``'s result once both succeeded.

    Args:
        what: The RPC's name, for errors.
        rpc: The client call (the engines' side of the collective).
        local: The trainer's side (connect, broadcast); it should bound its own waits.
        timeout_s: How long the RPC may take after ``local`` returned.
        local_timeout_s: How long ``local`` may take at all.
        discard: Releases ``local``'s result when it is not returned (a connected group, say).

    Raises:
        EngineRpcFailed: The RPC failed (its error is the cause).
        DeadlineExceeded: ``local`` or the RPC did not finish in time.
        Exception: ``local``'s own error, caused by the RPC's error when the RPC failed too.
    """
    changed = threading.Condition()
    device = current_device_index()
    call = _Call(f"wt-rpc-{what}", rpc, changed, None)
    mine = _Call(f"wt-local-{what}", local, changed, device, daemon=False)  # bounded by itself: joined at exit
    end = time.monotonic() + local_timeout_s
    with changed:
        while not mine.done and not (call.done and call.error is not None):
            left = end - time.monotonic()
            if left <= 0:
                break
            changed.wait(left)
    if not mine.done and call.error is not None:
        # The trainer's side usually fails within moments of the engines (the same vote or collective)
        # and says more (ManifestRejected quoting every worker): give it a short grace first.
        with changed:
            changed.wait_for(lambda: mine.done, timeout=LOCAL_GRACE_S)
    if not mine.done:
        mine.abandon(discard)
        if call.error is not None:
            raise EngineRpcFailed(f"{what} failed on the engines: {type(call.error).__name__}: {call.error}") from (
                call.error
            )
        raise DeadlineExceeded(f"the trainer's side of {what} did not finish within {local_timeout_s:g} s")
    if mine.error is not None:
        call.thread.join(min(timeout_s, RPC_GRACE_S))
        if call.error is not None:
            raise mine.error from call.error
        raise mine.error
    result = mine.result
    try:
        call.thread.join(timeout_s)
        if call.thread.is_alive():
            raise DeadlineExceeded(f"{what} did not return within {timeout_s:g} s after the trainer's side completed")
        if call.error is not None:
            raise EngineRpcFailed(f"{what} failed on the engines: {type(call.error).__name__}: {call.error}") from (
                call.error
            )
    except BaseException:
        if discard is not None:
            discard(result)  # pyright: ignore[reportArgumentType]
        raise
    return result  # pyright: ignore[reportReturnType]


def bounded_rpc(what: str, rpc: Callable[[], T], *, timeout_s: float) -> T:
    """Run ``rpc`` on a daemon thread and return its result, or raise its own error, within ``timeout_s``.

    Raises:
        DeadlineExceeded: ``rpc`` did not return within ``timeout_s`` (its thread, named ``wt-rpc-<what>``,
            is left running: a client call cannot be interrupted).
        Exception: ``rpc``'s own error, unchanged.
    """
    changed = threading.Condition()
    call = _Call(f"wt-rpc-{what}", rpc, changed, current_device_index())
    with changed:
        changed.wait_for(lambda: call.done, timeout=timeout_s)
    if not call.done:
        call.abandon(None)
        raise DeadlineExceeded(
            f"{what} did not return within {timeout_s:g} s (the call is left running on thread {call.thread.name})"
        )
    if call.error is not None:
        raise call.error
    return call.result  # pyright: ignore[reportReturnType]
