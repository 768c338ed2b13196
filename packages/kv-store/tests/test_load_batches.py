"""`load_batches`: rounds without repeated keys and calls under the piece cap (properties and worked examples).

The store fake here models the two transport hazards the planner exists for (a repeated key in one
get is written only into its last destination, a call over the cap fails with -800), so a plan that
broke either rule would leave destinations unwritten or failed, and the properties would see it.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.errors import StoreError
from ascend_dist.common.transfer_stats import Failure, FailureKind, TransferStats
from ascend_dist.kv_store.backends.base import piece_cap
from ascend_dist.kv_store.backends.memory import InMemoryBackend
from ascend_dist.kv_store.backends.mooncake import MooncakeBackend
from ascend_dist.kv_store.transfer.load_batches import STORE_ERROR, plan_gets, run_gets, run_puts, split_by_pieces


class HazardStore:
    """A fake of our `PoolBackend` Protocol with Mooncake 0.3.13's batch semantics, over a dict of "memory"."""

    name = "hazard"

    def __init__(self, objects: dict[str, bytes], cap: int | None, fail_calls: Sequence[int] = ()) -> None:
        self.objects = objects
        self.max_pieces_per_call = cap
        self.memory: dict[int, bytes] = {}
        self.calls: list[tuple[list[str], int]] = []
        self._fail = set(fail_calls)

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        pieces = sum(len(a) for a in addrs)
        self.calls.append((list(keys), pieces))
        if len(self.calls) - 1 in self._fail:
            raise StoreError("store down")
        if self.max_pieces_per_call is not None and pieces > self.max_pieces_per_call:
            return [-800] * len(keys)
        last = {k: i for i, k in enumerate(keys)}  # a repeated key: only its last destination is written
        codes = []
        for i, (key, a, s) in enumerate(zip(keys, addrs, sizes, strict=True)):
            data = self.objects.get(key)
            if data is None:
                codes.append(-704)
                continue
            if last[key] == i:
                pos = 0
                for addr, size in zip(a, s, strict=True):
                    self.memory[addr] = data[pos : pos + size]
                    pos += size
            codes.append(0)  # every copy reported loaded
        return codes

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        pieces = sum(len(a) for a in addrs)
        self.calls.append((list(keys), pieces))
        if self.max_pieces_per_call is not None and pieces > self.max_pieces_per_call:
            return [-800] * len(keys)
        return [0] * len(keys)


# entries: a key out of a few (so keys repeat), and a destination (block) out of a few (so some repeat exactly)
entries_st = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7), st.integers(1, 6)), max_size=40)


def build(entries: list[tuple[int, int, int]]) -> tuple[list[str], list[list[int]], list[list[int]]]:
    """Key ``k<n>``; block ``b`` has ``pieces`` pieces at ``1000 * b + j`` of size 1 (pieces fixed per key)."""
    keys, addrs, sizes = [], [], []
    for k, block, _ in entries:
        n = 1 + k % 4  # a key's value has the same number of pieces wherever it is loaded
        keys.append(f"k{k}")
        addrs.append([1000 * block + 10 * k + j for j in range(n)])
        sizes.append([1] * n)
    return keys, addrs, sizes


@settings(max_examples=300, deadline=None)
@given(entries=entries_st, cap=st.one_of(st.none(), st.integers(1, 12)))
def test_plan_covers_every_entry_once_without_repeats_under_the_cap(entries, cap) -> None:
    keys, addrs, sizes = build(entries)
    calls, source = plan_gets(keys, addrs, sizes, cap)
    fetched = [i for call in calls for i in call.entries]
    assert sorted(fetched) == sorted(set(fetched))  # no entry twice
    assert set(fetched) == {i for i, s in enumerate(source) if s == i}  # every entry fetched or shared
    for i, s in enumerate(source):
        assert s <= i and source[s] == s
        assert (keys[s], addrs[s], sizes[s]) == (keys[i], addrs[i], sizes[i])  # shares only identical destinations
    for call in calls:
        names = [keys[i] for i in call.entries]
        assert len(names) == len(set(names)), "a key repeats within one call"
        assert list(call.entries) == sorted(call.entries)  # the caller's order (TP rotation) is kept
        assert call.pieces == sum(len(addrs[i]) for i in call.entries)
        assert cap is None or call.pieces <= cap or len(call.entries) == 1
    if cap is None and len(set(keys)) == len(keys):
        assert len(calls) == min(1, len(keys))  # the common case stays one call


@settings(max_examples=300, deadline=None)
@given(entries=entries_st, cap=st.integers(4, 12), missing=st.sets(st.integers(0, 5), max_size=2))
def test_run_gets_writes_every_destination_through_the_hazards(entries, cap, missing) -> None:
    keys, addrs, sizes = build(entries)
    objects = {f"k{k}": bytes([k + 1]) * (1 + k % 4) for k in range(6) if k not in missing}
    store = HazardStore(objects, cap)
    result = run_gets(store, keys, addrs, sizes)
    assert result.error is None and result.calls == len(store.calls)
    for key, a, code in zip(keys, addrs, result.codes, strict=True):
        if key not in objects:
            assert code == -704
            continue
        assert code == 0
        assert b"".join(store.memory[x] for x in a) == objects[key]  # written, never just reported


def test_control_the_fake_store_has_the_hazards() -> None:
    """Without the planner the fake leaves the first copy of a repeated key unwritten and fails a big call."""
    store = HazardStore({"k0": b"a", "k1": b"b"}, cap=3)
    assert store.get(["k0", "k1", "k0"], [[0], [1], [2]], [[1]] * 3) == [0, 0, 0]
    assert store.memory == {1: b"b", 2: b"a"}  # destination 0 never written, reported loaded
    assert store.get(["k0", "k1"], [[0, 1], [2, 3]], [[1, 0], [1, 0]]) == [-800, -800]


def test_worked_example_the_issue_batch() -> None:
    """``[k0, k1, k0, k2, k2]`` into five blocks: two rounds; exact repeats of one block are fetched once."""
    keys = ["k0", "k1", "k0", "k2", "k2", "k1"]
    addrs = [[0], [1], [2], [3], [4], [1]]
    sizes = [[1]] * 6
    calls, source = plan_gets(keys, addrs, sizes, None)
    assert [c.entries for c in calls] == [(0, 1, 3), (2, 4)]
    assert source == [0, 1, 2, 3, 4, 1]  # entry 5 = entry 1 (same key, same block)
    calls, _ = plan_gets(keys, addrs, sizes, 2)
    assert [c.entries for c in calls] == [(0, 1), (3,), (2, 4)]
    assert [c.entries for c in split_by_pieces([0, 1, 2], [[1, 2, 3], [4], [5]], 2)] == [(0,), (1, 2)]


def test_a_call_that_raises_fails_its_entries_only() -> None:
    objects = {"a": b"x", "b": b"y"}
    store = HazardStore(objects, cap=1, fail_calls=[0])
    result = run_gets(store, ["a", "b"], [[1], [2]], [[1], [1]])
    assert result.codes == [STORE_ERROR, 0] and isinstance(result.error, StoreError)
    assert store.memory == {2: b"y"}


def test_puts_are_cut_at_the_cap() -> None:
    store = HazardStore({}, cap=4)
    result = run_puts(store, ["a", "b", "c"], [[1, 2], [3, 4], [5, 6, 7, 8, 9]], [[1] * 2, [1] * 2, [1] * 5])
    assert [pieces for _, pieces in store.calls] == [4, 5]
    assert result.codes == [0, 0, -800]  # a single key over the cap: failed, never stored


def test_each_call_is_recorded_with_the_bytes_of_the_keys_it_moved() -> None:
    stats = TransferStats("pool")
    store = HazardStore({"a": b"xyz", "c": b"q"}, cap=None)
    result = run_gets(store, ["a", "b", "c"], [[1, 2], [3], [4]], [[2, 1], [5], [1]], stats)
    assert result.codes == [0, -704, 0]
    data = stats.take()
    assert data is not None
    assert [(t.direction, t.nbytes, t.descriptors) for t in data.transfers] == [("load", 4, 3)]  # b moved nothing
    assert data.failures == [Failure("pool", "load", FailureKind.LEASE_EXPIRED, 1)]  # not found: evicted
    assert stats.take() is None  # taken once


def test_a_raising_call_is_a_failure_per_key_and_moves_no_bytes() -> None:
    stats = TransferStats("pool")
    store = HazardStore({"a": b"x", "b": b"y"}, cap=1, fail_calls=[0])
    run_gets(store, ["a", "b"], [[1], [2]], [[1], [1]], stats)
    data = stats.take()
    assert data is not None
    assert [(t.nbytes, t.descriptors) for t in data.transfers] == [(1, 1)]  # only the second call moved anything
    assert data.failures == [Failure("pool", "load", FailureKind.PEER_UNREACHABLE, 1)]  # the store was unreachable


def test_puts_are_recorded_as_saves_with_their_failed_keys() -> None:
    stats = TransferStats("pool")
    store = HazardStore({}, cap=4)
    run_puts(store, ["a", "b", "c"], [[1, 2], [3, 4], [5, 6, 7, 8, 9]], [[1] * 2, [1] * 2, [1] * 5], stats)
    data = stats.take()
    assert data is not None
    assert [(t.direction, t.nbytes, t.descriptors) for t in data.transfers] == [("save", 4, 4)]
    assert data.failures == [Failure("pool", "save", FailureKind.PEER_UNREACHABLE, 1)]  # -800 TRANSFER_FAIL


def test_a_store_that_moved_nothing_records_nothing() -> None:
    stats = TransferStats("pool")
    run_gets(HazardStore({}, cap=None), [], [], [], stats)
    run_puts(HazardStore({}, cap=None), [], [], [], stats)
    assert stats.take() is None


def test_the_backends_declare_their_caps() -> None:
    assert MooncakeBackend.max_pieces_per_call is not None and MooncakeBackend.max_pieces_per_call < 2048
    assert piece_cap(InMemoryBackend()) is None
    assert piece_cap(object()) is None  # a backend without the attribute: no limit


def test_plan_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        plan_gets(["a"], [], [], None)
    with pytest.raises(ValueError, match="positive"):
        plan_gets([], [], [], 0)
