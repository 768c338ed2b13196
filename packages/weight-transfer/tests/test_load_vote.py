"""The npu_ipc load vote (issue 25 item 4): every rank of a replica keeps an update, or every rank restores.

Real parts: a `torch.distributed.TCPStore` on 127.0.0.1 hosted by rank 0 (`replica_store`), ranks as
threads of this process (the vote is keys in the store, no collective); the replica exchange is a
fake of our own `ReplicaExchange` Protocol over a thread barrier. The IPC workers load through
shared memory (`CpuSimRuntime`) into fakes of our own `WeightSink` whose loader can fail half-way.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.common.errors import ProtocolError
from ascend_dist.weight_transfer._demo.procs import synthetic_weights
from ascend_dist.weight_transfer.errors import LoadFailed, LoadRestored, WeightsInconsistent
from ascend_dist.weight_transfer.ipc_trainer import IpcTrainer
from ascend_dist.weight_transfer.ipc_worker import IpcWorker
from ascend_dist.weight_transfer.load_vote import StoreLoadVote, VoteOutcome, replica_store
from ascend_dist.weight_transfer.messages import IpcParams

from .conftest import ThreadReplica
from .flat_model import BUFFER, SPECS, FailingSink, Model, digests, want

T = TypeVar("T")


def _on_every_rank(world_size: int, fn: Callable[[int], T]) -> list[T]:
    with ThreadPoolExecutor(max_workers=world_size) as pool:
        return [f.result(60) for f in [pool.submit(fn, r) for r in range(world_size)]]


@pytest.fixture
def stores() -> Iterator[list[Any]]:
    """The stores of a 3-rank replica (rank 0 hosts), joined through `replica_store`."""
    replicas = ThreadReplica.group(3)
    joined = _on_every_rank(3, lambda r: replica_store(replicas[r], timeout_s=10))
    assert all(s is not None for s in joined)
    yield joined
    joined.clear()  # rank 0's store stops when its last reference goes


def _votes(stores: list[Any], timeout_s: float = 10.0) -> list[StoreLoadVote]:
    return [StoreLoadVote(s, r, len(stores), timeout_s=timeout_s) for r, s in enumerate(stores)]


def test_every_rank_loaded_commits_everywhere(stores: list[Any]) -> None:
    votes = _votes(stores)
    outcomes = _on_every_rank(3, lambda r: votes[r].vote("a1", None))
    assert outcomes == [VoteOutcome(commit=True)] * 3


def test_one_rank_failing_makes_every_rank_restore_naming_it(stores: list[Any]) -> None:
    votes = _votes(stores)
    outcomes = _on_every_rank(3, lambda r: votes[r].vote("a2", "loader: KeyError" if r == 2 else None))
    assert [o.commit for o in outcomes] == [False] * 3
    assert all(o.failures == {2: "loader: KeyError"} for o in outcomes)


def test_a_rank_that_never_votes_ends_the_vote_at_its_deadline_and_a_late_rank_follows(stores: list[Any]) -> None:
    votes = _votes(stores, timeout_s=0.5)
    started = time.monotonic()
    early = _on_every_rank(2, lambda r: votes[r].vote("a3", None))  # ranks 0 and 1; rank 2 is late
    assert 0.5 <= time.monotonic() - started < 5
    assert all(not o.commit and set(o.failures) == {2} for o in early)
    assert "vote_timeout_s=0.5" in early[0].failures[2]
    # rank 2 loaded fine and sees every vote "ok": deciding on its own it would commit while 0 and 1 restored
    late = votes[2].vote("a3", None)
    assert late == early[0]


def test_a_withdrawn_rank_ends_the_others_vote_at_once(stores: list[Any]) -> None:
    votes = _votes(stores, timeout_s=30.0)
    votes[1].withdraw("a4", "ProtocolError: chunk 3/5 arrived, expected 2/5")
    started = time.monotonic()
    outcomes = _on_every_rank(2, lambda r: votes[r * 2].vote("a4", None))  # ranks 0 and 2
    assert time.monotonic() - started < 5  # not the 30 s deadline
    assert all(not o.commit and "chunk 3/5" in o.failures[1] for o in outcomes)
    assert votes[1].vote("a4", None) == outcomes[0]  # a withdrawn rank cannot vote yes afterwards


def test_an_unreadable_vote_never_commits(stores: list[Any]) -> None:
    votes = _votes(stores)
    stores[1].set("load-vote/a5/rank/1", "not json")  # a foreign writer on the store
    outcomes = _on_every_rank(2, lambda r: votes[r * 2].vote("a5", None))
    assert all(not o.commit and "unreadable" in o.failures[1] for o in outcomes)


def test_each_update_deletes_the_keys_of_the_one_before(stores: list[Any]) -> None:
    votes = _votes(stores)
    for k in range(20):
        _on_every_rank(3, lambda r, k=k: votes[r].vote(f"b{k}", None))
    assert stores[0].num_keys() <= 3 * (3 + 1) + 1  # three updates' keys at most (+ the store's own)


def test_the_store_listens_on_loopback_only(stores: list[Any]) -> None:
    port = stores[0].port
    listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    local = {(entry[1], entry[3]) for entry in listening}
    assert (f"0100007F:{port:04X}", "0A") in local  # 127.0.0.1, LISTEN
    assert (f"00000000:{port:04X}", "0A") not in local
    with socket.socket() as probe:  # reachable on 127.0.0.1 (the control of the check above)
        probe.connect(("127.0.0.1", port))


class ElsewhereReplica(ThreadReplica):
    """A rank that sees rank 0's offer as coming from another node (its loopback is not rank 0's)."""

    def broadcast_from_first(self, payload: bytes) -> bytes:
        return super().broadcast_from_first(payload).replace(b'"node": "', b'"node": "elsewhere/')


def test_ranks_on_other_loopbacks_vote_nowhere() -> None:
    barrier, shared = threading.Barrier(2), {}
    replicas = [ThreadReplica(0, 2, barrier, shared), ElsewhereReplica(1, 2, barrier, shared)]
    assert _on_every_rank(2, lambda r: replica_store(replicas[r], timeout_s=5)) == [None, None]


# --- the vote inside IpcWorker: two ranks of one replica loading the same update ---


@pytest.fixture
def runtime() -> Iterator[CpuSimRuntime]:
    rt = CpuSimRuntime()
    yield rt
    rt.close()


def _replica(stores: list[Any], count: int, timeout_s: float) -> tuple[list[IpcWorker], list[FailingSink]]:
    sinks = [FailingSink(Model(1)) for _ in range(count)]
    workers = []
    for rank, sink in enumerate(sinks):
        vote = StoreLoadVote(stores[rank], rank, count, timeout_s=timeout_s)
        worker = IpcWorker(sink, CpuSimRuntime(), uuid="h-cpu0", peers=count, vote=vote)
        worker.guard.install(sink.module)
        worker.init(IpcParams(packed=True, buffer_size_bytes=BUFFER))
        workers.append(worker)
    return workers, sinks


class FanOutClient:
    """A `WeightSyncClient` calling every worker of the replica concurrently, as vLLM's collective RPC does.

    ``tamper(rank, update_info)`` may change what one rank receives; with ``keep_going`` the errors
    are collected instead of raised, so the trainer goes on sending (the other ranks still get every chunk).
    """

    def __init__(self, workers: list[IpcWorker], tamper: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None,
                 keep_going: bool = False) -> None:  # fmt: skip
        self.workers, self.tamper, self.keep_going = workers, tamper, keep_going
        self.errors: list[tuple[int, BaseException]] = []

    def _each(self, call: Callable[[int, IpcWorker], object]) -> None:
        with ThreadPoolExecutor(max_workers=len(self.workers)) as pool:
            futures = [pool.submit(call, r, w) for r, w in enumerate(self.workers)]
        failed = [(r, f.exception()) for r, f in enumerate(futures) if f.exception() is not None]
        self.errors += failed  # type: ignore[arg-type]
        if failed and not self.keep_going:
            raise failed[0][1]  # type: ignore[misc]

    def first_errors(self) -> dict[int, BaseException]:
        """Each rank's first error (later calls of a failed update fail too: no update is active)."""
        first: dict[int, BaseException] = {}
        for rank, exc in self.errors:
            first.setdefault(rank, exc)
        return first

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        pass  # the workers were initialised by the test

    def start_weight_update(self) -> None:
        self._each(lambda r, w: w.start())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._each(lambda r, w: w.update(self.tamper(r, update_info) if self.tamper else update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each(lambda r, w: w.finish())


def _trainer(client: FanOutClient) -> IpcTrainer:
    return IpcTrainer(client, CpuSimRuntime(), packed=True, buffer_size_bytes=BUFFER, uuid="h-cpu0")


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_loader_failing_on_one_rank_restores_every_rank_of_the_replica(stores: list[Any], failing_rank: int) -> None:
    """Before: the failing rank restored and refused to run while the other served the new weights."""
    workers, sinks = _replica(stores, 2, timeout_s=30.0)
    client = FanOutClient(workers)
    trainer = _trainer(client)
    sinks[failing_rank].fail_after = len(SPECS) // 2  # half its tensors written, then its loader raises
    with pytest.raises(LoadRestored, match=rf"rank {failing_rank}: the model's loader failed \(KeyError"):
        trainer.send(synthetic_weights(SPECS, 2))
    assert [type(e) for _, e in client.errors] == [LoadRestored, LoadRestored]  # every rank says so
    assert [digests(s.module) for s in sinks] == [want(1), want(1)]  # both on the previous weights
    for sink in sinks:
        sink.module()  # and both run: no guard tripped
    sinks[failing_rank].fail_after = None  # control: the same replica takes the next update everywhere
    trainer.send(synthetic_weights(SPECS, 3))
    assert [digests(s.module) for s in sinks] == [want(3), want(3)]


def test_a_rank_that_dropped_the_update_makes_the_loading_rank_restore_at_once(stores: list[Any]) -> None:
    """Rank 1 refuses a chunk the RPC layer garbled for it; rank 0 gets every chunk and loads."""

    def garble_rank_1(rank: int, info: dict[str, Any]) -> dict[str, Any]:
        if rank == 1 and info["chunk"]["chunk_index"] == 1:
            return {"chunk": {**info["chunk"], "chunk_index": 2}}
        return info

    workers, sinks = _replica(stores, 2, timeout_s=60.0)
    client = FanOutClient(workers, tamper=garble_rank_1, keep_going=True)
    started = time.monotonic()
    _trainer(client).send(synthetic_weights(SPECS, 2))
    assert time.monotonic() - started < 10  # rank 0 did not wait out its 60 s vote
    by_rank = client.first_errors()
    assert isinstance(by_rank[1], ProtocolError)
    assert isinstance(by_rank[0], LoadRestored) and "dropped the update" in str(by_rank[0])
    assert [digests(s.module) for s in sinks] == [want(1), want(1)]


def test_without_a_vote_the_other_rank_keeps_the_new_weights(stores: list[Any]) -> None:
    """The control of the tests above: the same failure with no vote leaves the two ranks on different weights."""
    workers, sinks = _replica(stores, 2, timeout_s=30.0)
    for worker in workers:
        worker.vote = None
    client = FanOutClient(workers, keep_going=True)
    sinks[1].fail_after = 2
    _trainer(client).send(synthetic_weights(SPECS, 2))
    assert isinstance(client.first_errors()[1], LoadFailed)
    assert digests(sinks[0].module) == want(2) and digests(sinks[1].module) == want(1)


class BrokenVote:
    """A `LoadVote` whose store went away after this rank loaded (the others' outcome is unknown)."""

    rank, world_size = 0, 2

    def vote(self, update_id: str, failure: str | None) -> VoteOutcome:
        raise ConnectionResetError("the store's connection was reset")

    def withdraw(self, update_id: str, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_vote_that_fails_restores_this_rank_and_refuses_to_run() -> None:
    """Restoring alone is not enough: the other ranks may have committed, so this rank must not serve."""
    sink = FailingSink(Model(1))
    worker = IpcWorker(sink, CpuSimRuntime(), uuid="h-cpu0", peers=2, vote=BrokenVote())
    worker.guard.install(sink.module)
    worker.init(IpcParams(packed=True, buffer_size_bytes=BUFFER))
    with pytest.raises(LoadFailed, match="outcome is unknown; on rank 0 it restored its previous weights"):
        _trainer(FanOutClient([worker])).send(synthetic_weights(SPECS, 2))
    assert digests(sink.module) == want(1)
    with pytest.raises(WeightsInconsistent, match="load vote failed"):
        sink.module()
