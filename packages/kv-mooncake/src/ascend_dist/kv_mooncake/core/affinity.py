"""Keep transfer threads off the CPUs the model's forward thread is bound to.

Runs in: worker processes (the connectors' worker halves, at registration and when they start
threads). vLLM's CPU worker binds its forward thread to its OpenMP cores, and every thread
created after that inherits the binding: a side-channel server, a pool of pull threads, the
Mooncake engine's own threads. Under ``vllm serve`` the forward thread spins between steps
(its message-queue busy wait, and the engine steps continuously while a transfer is pending),
so threads confined to its core wait behind it, and a pull that takes milliseconds took over a
minute. vLLM itself reserves cores for the engine process and the KV connector and leaves them
out of the OpenMP binding; these are the CPUs transfer threads should use.

`transfer_cpus` names them once, from the thread that will create the transfer threads (the
bound forward thread): every CPU the process may run on except the ones that thread is bound
to, or all of them when that leaves none (one core, or no binding). `running_on` moves the
calling thread there for a block (threads, native ones included, started inside inherit it) and
puts it back after; `move_current_thread` is for a thread's own start (a pool's initializer).
Without ``sched_setaffinity`` (not Linux) all three do nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["move_current_thread", "running_on", "transfer_cpus"]

logger = logging.getLogger(__name__)

_ANY_CPU = range(4096)  # the kernel keeps only the CPUs the process's cpuset allows


def _supported() -> bool:
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def transfer_cpus() -> frozenset[int] | None:
    """The CPUs for transfer threads, seen from the calling (forward) thread; None: not supported.

    Every CPU the process's cpuset allows minus the calling thread's current ones; all allowed
    CPUs when that difference is empty. The calling thread's affinity is left as it was.
    """
    if not _supported():
        return None
    bound = frozenset(os.sched_getaffinity(0))
    try:
        os.sched_setaffinity(0, _ANY_CPU)  # widened to what the cpuset allows, then read back
        allowed = frozenset(os.sched_getaffinity(0))
    except OSError as exc:  # a seccomp filter or an odd kernel: leave every thread where it is
        logger.warning("cannot read the CPUs this process may use (%s); transfer threads stay where they start", exc)
        return None
    finally:
        os.sched_setaffinity(0, bound)
    return (allowed - bound) or allowed


def move_current_thread(cpus: frozenset[int] | None) -> None:
    """Bind the calling thread to ``cpus`` (None: leave it)."""
    if cpus is not None and _supported():
        os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def running_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the block on ``cpus``; threads started in it keep them. None: the block runs unchanged."""
    if cpus is None or not _supported():
        yield
        return
    before = frozenset(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
