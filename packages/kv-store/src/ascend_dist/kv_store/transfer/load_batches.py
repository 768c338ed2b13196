"""Splitting one step's loads (and saves) into store calls that the transport executes faithfully.

Runs in: worker processes (the forward pass's thread for synchronous loads, the receiving threads
otherwise). Pure planning plus a loop of ``get`` calls; no threads or waits of its own.

Why: a batch ``get`` is not a list of independent copies.

* **A repeated key**: Mooncake 0.3.13 writes a key that appears twice in one batch only into its
  *last* destination and reports success for every copy (two requests of one step sharing a pooled
  chunk in different blocks, prefix caching off). So a key appears at most once per call: its
  k-th occurrence goes into the k-th round, and rounds run one after another. An occurrence with
  exactly the destinations of an earlier one (the same block: prefix caching on) is not fetched
  again; it shares that occurrence's result.
* **Too many pieces**: Mooncake's TCP transport fails a batch with more than about 2,048 pieces
  (``(addr, size)`` pairs) per peer with -800. Each round is cut into calls of at most
  ``max_pieces`` pieces (the backend's ``max_pieces_per_call``, see `piece_cap`; None = no limit);
  a single key with more pieces than that goes alone in its call (the transport then reports it
  failed, never loaded). Puts are cut the same way (`run_puts`): the limit holds for them too.

Rounds need no scratch memory and no device copy: every destination is written by the store itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from ascend_dist.common.errors import StoreError
from ascend_dist.common.transfer_stats import Direction, TransferStats
from ascend_dist.kv_store.backends.base import PoolBackend, piece_cap
from ascend_dist.kv_store.transfer.pool_stats import record_call

__all__ = ["STORE_ERROR", "StoreCall", "CallResults", "plan_gets", "run_gets", "run_puts", "split_by_pieces"]

# The code of an entry whose call raised `StoreError` (the store gave no per-key answer).
STORE_ERROR: Final = -1


@dataclass(frozen=True)
class StoreCall:
    """One ``get`` or ``put``: positions of its entries (in the caller's order) and its piece count."""

    entries: tuple[int, ...]
    pieces: int


@dataclass(frozen=True)
class CallResults:
    """One code per entry (0 done), the first `StoreError` a call raised (if any), and the calls made."""

    codes: list[int]
    error: StoreError | None = None
    calls: int = 0


def plan_gets(
    keys: Sequence[str],
    addrs: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    max_pieces: int | None,
) -> tuple[list[StoreCall], list[int]]:
    """The calls that fetch every entry, and for each entry the entry whose result it takes.

    Within a call no key repeats and the pieces total at most ``max_pieces`` (unless one entry alone
    exceeds it). Entries keep their order inside a call, so the TP-rank rotation of the caller holds.

    Returns:
        ``(calls, source)``: ``source[i] == i`` for an entry that is fetched, else the position of the
        earlier entry with the same key and the same destinations, whose result entry ``i`` shares.

    Raises:
        ValueError: Lengths differ, or ``max_pieces`` is not positive.
    """
    if not len(keys) == len(addrs) == len(sizes):
        raise ValueError(f"keys, addrs and sizes differ in length: {len(keys)}, {len(addrs)}, {len(sizes)}")
    if max_pieces is not None and max_pieces < 1:
        raise ValueError(f"max_pieces must be positive or None, got {max_pieces}")
    source: list[int] = []
    first_by_dest: dict[tuple[str, tuple[int, ...], tuple[int, ...]], int] = {}
    occurrences: dict[str, int] = {}
    rounds: list[list[int]] = []
    for i, key in enumerate(keys):
        dest = (key, tuple(addrs[i]), tuple(sizes[i]))
        earlier = first_by_dest.get(dest)
        if earlier is not None:
            source.append(earlier)
            continue
        first_by_dest[dest] = i
        source.append(i)
        n = occurrences.get(key, 0)
        occurrences[key] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(i)
    calls = [call for members in rounds for call in split_by_pieces(members, addrs, max_pieces)]
    return calls, source


def split_by_pieces(members: Sequence[int], addrs: Sequence[Sequence[int]], max_pieces: int | None) -> list[StoreCall]:
    """``members`` (positions into ``addrs``) cut in order into calls of at most ``max_pieces`` pieces.

    An entry with more pieces than ``max_pieces`` forms a call of its own.
    """
    calls: list[StoreCall] = []
    current: list[int] = []
    pieces = 0
    for i in members:
        n = len(addrs[i])
        if current and max_pieces is not None and pieces + n > max_pieces:
            calls.append(StoreCall(tuple(current), pieces))
            current, pieces = [], 0
        current.append(i)
        pieces += n
    if current:
        calls.append(StoreCall(tuple(current), pieces))
    return calls


def run_gets(
    backend: PoolBackend,
    keys: Sequence[str],
    addrs: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    stats: TransferStats | None = None,
) -> CallResults:
    """Fetch every entry with `plan_gets`'s calls, in order; one code per entry of the input.

    A call that raises `StoreError` marks its entries `STORE_ERROR` and the next calls still run
    (each is independent; a backend whose store is down raises at once). ``stats``: each call is
    recorded there as a ``load`` (`pool_stats.record_call`).
    """
    calls, source = plan_gets(keys, addrs, sizes, piece_cap(backend))
    out = _run(backend.get, backend.name, calls, keys=keys, addrs=addrs, sizes=sizes, stats=stats, direction="load")
    return CallResults([out.codes[s] for s in source], out.error, out.calls)


def run_puts(
    backend: PoolBackend,
    keys: Sequence[str],
    addrs: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    stats: TransferStats | None = None,
) -> CallResults:
    """Store every entry (keys already distinct) in calls of at most the backend's piece cap; one code per entry.

    ``stats``: each call is recorded there as a ``save`` (`pool_stats.record_call`).
    """
    calls = split_by_pieces(range(len(keys)), addrs, piece_cap(backend))
    return _run(backend.put, backend.name, calls, keys=keys, addrs=addrs, sizes=sizes, stats=stats, direction="save")


def _run(
    op: Callable[[Sequence[str], Sequence[Sequence[int]], Sequence[Sequence[int]]], list[int]],
    name: str,
    calls: Sequence[StoreCall],
    *,
    keys: Sequence[str],
    addrs: Sequence[Sequence[int]],
    sizes: Sequence[Sequence[int]],
    stats: TransferStats | None,
    direction: Direction,
) -> CallResults:
    codes = [STORE_ERROR] * len(keys)
    error: StoreError | None = None
    for call in calls:
        idx = call.entries
        call_sizes = [sizes[i] for i in idx]
        start = time.perf_counter()
        try:
            got = op([keys[i] for i in idx], [addrs[i] for i in idx], call_sizes)
        except StoreError as exc:
            error = error or exc
            record_call(stats, direction, time.perf_counter() - start, call_sizes, exc)
            continue
        seconds = time.perf_counter() - start
        if len(got) != len(idx):  # a store answering for other keys must not pass as done
            error = error or StoreError(f"{name} answered {len(got)} codes for {len(idx)} keys")
            record_call(stats, direction, seconds, call_sizes, [STORE_ERROR] * len(idx))  # kind: other
            continue
        for i, code in zip(idx, got, strict=True):
            codes[i] = int(code)
        record_call(stats, direction, seconds, call_sizes, [codes[i] for i in idx])
    return CallResults(codes, error, len(calls))
