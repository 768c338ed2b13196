"""The broadcast engine end to end: a trainer (this process) and 2 worker processes over gloo."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ascend_dist.common.device import close_runtime
from ascend_dist.hccl_ctypes import PyHcclCommunicator
from ascend_dist.weight_transfer._demo.procs import (
    Spec,
    WorkerProcess,
    param_digests,
    synthetic_specs,
    synthetic_weights,
)
from ascend_dist.weight_transfer.collective import CommunicatorCollective, gloo_collective, hccl_collective
from ascend_dist.weight_transfer.errors import ManifestRejected, UpdateAborted, WorkerLost
from ascend_dist.weight_transfer.trainer import BroadcastTrainer

from .conftest import free_port

SPECS = synthetic_specs(24, 96 * 1024, dtypes=("float32", "bfloat16", "float16", "int8", "float8_e4m3fn"))
TIMEOUT_S = 20.0


def _connect(
    workers: list[WorkerProcess], *, packed: bool, buffer: int, layout: list[tuple[int, int, int]],
    die_after: int | None = None, op_timeout_s: float = TIMEOUT_S, direct: int = 0, collective: str = "gloo",
) -> BroadcastTrainer:  # fmt: skip
    """Start init on every worker, connect the trainer, return it once all joined."""
    port = free_port()
    for i, (proc, (dp, replica, rank)) in enumerate(zip(workers, layout, strict=True)):
        proc.send(
            "init", master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=len(workers) + 1,
            dp_index=dp, replica_size=replica, rank_in_replica=rank, packed=packed, buffer_size_bytes=buffer,
            num_buffers=2, op_timeout_s=op_timeout_s, die_after_buffers=die_after if i == 1 else None,
            direct_threshold_bytes=direct, collective=collective,
        )  # fmt: skip
    trainer = BroadcastTrainer.connect(
        "127.0.0.1", port, len(workers) + 1, packed=packed, buffer_size_bytes=buffer, num_buffers=2,
        op_timeout_s=op_timeout_s, direct_threshold_bytes=direct,
        collective_factory=hccl_collective if collective == "hccl" else gloo_collective,
    )  # fmt: skip
    expected = "CommunicatorCollective" if collective == "hccl" else "GlooCollective"
    for i, proc in enumerate(workers):
        reply = proc.reply(TIMEOUT_S)
        assert reply["ok"] and reply["collective"] == ("_DieAfter" if die_after and i == 1 else expected), reply
    return trainer


def _update(trainer: BroadcastTrainer, workers: list[WorkerProcess], specs: list[Spec], seed: int) -> dict[str, str]:
    weights = synthetic_weights(specs, seed)
    for proc in workers:
        assert proc.call("start")["ok"]
        proc.send("update", names=[s[0] for s in specs], dtype_names=[s[1] for s in specs],
                  shapes=[list(s[2]) for s in specs])  # fmt: skip
    trainer.send(weights)
    for proc in workers:
        reply = proc.reply(TIMEOUT_S)
        assert reply["ok"], reply
        assert proc.call("finish")["ok"]
    return param_digests(weights)


@pytest.mark.parametrize(("packed", "buffer", "direct"), [(True, 4096, 0), (True, 1 << 20, 0), (True, 2048, 3000),
                                                          (False, 4096, 0)])  # fmt: skip
def test_three_updates_bit_exact_on_every_worker(spawn_workers: Callable[..., list[WorkerProcess]],
                                                 packed: bool, buffer: int, direct: int) -> None:  # fmt: skip
    workers = spawn_workers(2, SPECS)
    # worker A: DP replica 0, worker B: DP replica 1 (replica size 1) -> group ranks 1 and 2
    trainer = _connect(workers, packed=packed, buffer=buffer, layout=[(0, 1, 0), (1, 1, 0)], direct=direct)
    try:
        for seed in (1, 2, 3):
            expected = _update(trainer, workers, SPECS, seed)
            for proc in workers:
                assert proc.call("digest")["digests"] == expected
    finally:
        trainer.shutdown()


@pytest.mark.parametrize(("packed", "buffer", "direct"), [(True, 4096, 3000), (False, 4096, 0)])
def test_updates_through_the_real_pyhccl_communicator_are_bit_exact(
    spawn_workers: Callable[..., list[WorkerProcess]], packed: bool, buffer: int, direct: int
) -> None:
    """`hccl_collective` on every rank: PyHcclCommunicator (gloo engine, CPU runtime) on a stateless group."""
    workers = spawn_workers(2, SPECS)
    trainer = _connect(workers, packed=packed, buffer=buffer, layout=[(0, 1, 0), (1, 1, 0)], direct=direct,
                       collective="hccl")  # fmt: skip
    try:
        collective = trainer.collective
        assert isinstance(collective, CommunicatorCollective)
        comm = collective.communicator
        assert isinstance(comm, PyHcclCommunicator) and comm.engine == "gloo" and comm.world_size == 3
        for seed in (4, 5):
            expected = _update(trainer, workers, SPECS, seed)
            for proc in workers:
                assert proc.call("digest")["digests"] == expected
    finally:
        trainer.shutdown()
        close_runtime()  # the trainer's communicator ran on this process's runtime: stop its threads


def test_worker_ranks_follow_dp_index_and_replica_rank(spawn_workers: Callable[..., list[WorkerProcess]]) -> None:
    workers = spawn_workers(2, SPECS[:3])
    port = free_port()
    # one DP replica of size 2: ranks 0 and 1 inside it -> group ranks 1 and 2 (given in reverse order)
    for proc, rank in zip(workers, (1, 0), strict=True):
        proc.send("init", master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=3, dp_index=0,
                  replica_size=2, rank_in_replica=rank, packed=True, buffer_size_bytes=64, num_buffers=2,
                  op_timeout_s=TIMEOUT_S)  # fmt: skip
    trainer = BroadcastTrainer.connect("127.0.0.1", port, 3, buffer_size_bytes=64, op_timeout_s=TIMEOUT_S)
    try:
        assert [proc.reply(TIMEOUT_S)["rank"] for proc in workers] == [2, 1]
        expected = _update(trainer, workers, SPECS[:3], 7)
        assert all(proc.call("digest")["digests"] == expected for proc in workers)
    finally:
        trainer.shutdown()


def test_manifest_mismatch_is_refused_before_any_byte_and_session_recovers(
    spawn_workers: Callable[..., list[WorkerProcess]],
) -> None:
    workers = spawn_workers(2, SPECS)
    trainer = _connect(workers, packed=True, buffer=4096, layout=[(0, 1, 0), (1, 1, 0)])
    try:
        before = _update(trainer, workers, SPECS, 1)
        bad = list(SPECS)
        name, dtype, shape = bad[3]
        bad[3] = (name, dtype, (shape[0] + 1, *shape[1:]))
        for proc in workers:
            assert proc.call("start")["ok"]
            proc.send("update", names=[s[0] for s in bad], dtype_names=[s[1] for s in bad],
                      shapes=[list(s[2]) for s in bad])  # fmt: skip
        with pytest.raises(ManifestRejected, match=rf"shape of tensor '{name}'"):
            trainer.send(synthetic_weights(SPECS, 2))
        for proc in workers:
            reply = proc.reply(TIMEOUT_S)
            assert reply["error"] == "ManifestRejected" and name in reply["message"]
            assert proc.call("digest")["digests"] == before  # nothing was written
            assert proc.call("finish")["error"] == "UpdateStateError"  # the failed update closed the session
        assert _update(trainer, workers, SPECS, 3)  # and a new one goes through
    finally:
        trainer.shutdown()


def test_start_twice_and_update_without_start_are_typed_errors(
    spawn_workers: Callable[..., list[WorkerProcess]],
) -> None:
    (worker,) = spawn_workers(1, SPECS[:2])
    port = free_port()
    worker.send("init", master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, dp_index=0,
                replica_size=1, rank_in_replica=0, packed=True, buffer_size_bytes=64, num_buffers=2,
                op_timeout_s=TIMEOUT_S)  # fmt: skip
    trainer = BroadcastTrainer.connect("127.0.0.1", port, 2, buffer_size_bytes=64, op_timeout_s=TIMEOUT_S)
    try:
        assert worker.reply(TIMEOUT_S)["ok"]
        reply = worker.call("update", names=[], dtype_names=[], shapes=[])
        assert reply["error"] == "UpdateStateError" and "start_weight_update" in reply["message"]
        assert worker.call("start")["ok"]
        reply = worker.call("start")
        assert reply["error"] == "UpdateStateError" and "finish_weight_update" in reply["message"]
        assert worker.call("finish")["ok"]
        assert _update(trainer, [worker], SPECS[:2], 5)
    finally:
        trainer.shutdown()


@pytest.mark.parametrize("collective", ["gloo", "hccl"])
def test_worker_dying_mid_update_is_named_and_survivor_keeps_previous_weights(
    spawn_workers: Callable[..., list[WorkerProcess]], collective: str
) -> None:
    """On the HCCL path too (issue 25 item 4: its typed collective errors skipped the heartbeat check)."""
    import time

    workers = spawn_workers(2, SPECS)
    # worker index 1 (group rank 2) exits after its 3rd data buffer of an update
    trainer = _connect(workers, packed=True, buffer=4096, layout=[(0, 1, 0), (1, 1, 0)], die_after=3,
                       op_timeout_s=5.0, collective=collective)  # fmt: skip
    try:
        survivor = workers[0]
        small = SPECS[:2]  # update 1 fits in 3 buffers: everyone commits it
        for proc in workers:
            assert proc.call("start")["ok"]
            proc.send("update", names=[s[0] for s in small], dtype_names=[s[1] for s in small],
                      shapes=[list(s[2]) for s in small])  # fmt: skip
        trainer.send(synthetic_weights(small, 1))
        assert all(proc.reply(TIMEOUT_S)["ok"] for proc in workers)
        before = survivor.call("digest")["digests"]
        survivor.call("finish")
        workers[1].call("finish")
        for proc in workers:
            assert proc.call("start")["ok"]
            proc.send("update", names=[s[0] for s in SPECS], dtype_names=[s[1] for s in SPECS],
                      shapes=[list(s[2]) for s in SPECS])  # fmt: skip
        t0 = time.monotonic()
        with pytest.raises(WorkerLost, match=r"worker ranks \[2\]") as info:
            trainer.send(synthetic_weights(SPECS, 2))
        assert time.monotonic() - t0 < 5.0 + 3.0
        assert info.value.ranks == (2,)
        reply = survivor.reply(TIMEOUT_S)
        assert not reply["ok"] and reply["error"] == "UpdateAborted"
        assert survivor.call("digest")["digests"] == before  # never a half-written parameter
        workers[1].process.join(5)
        assert workers[1].process.exitcode == 17
        with pytest.raises(UpdateAborted, match="connect again"):
            trainer.send(synthetic_weights(SPECS, 3))
    finally:
        trainer.shutdown()
        close_runtime()  # the hccl trainer's communicator ran on this process's runtime: stop its threads
