"""The IPC engine end to end on the CPU: shared-memory handles from this process to 2 worker processes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.weight_transfer._demo.procs import (
    Spec,
    WorkerProcess,
    param_digests,
    synthetic_specs,
    synthetic_weights,
)
from ascend_dist.weight_transfer.ipc_trainer import IpcTrainer

SPECS: list[Spec] = synthetic_specs(15, 48 * 1024, dtypes=("float32", "bfloat16", "float8_e5m2", "int64"))
TIMEOUT_S = 20.0


class ProcessClient:
    """A `WeightSyncClient` that forwards each call to worker processes as JSON commands."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers
        self.updates = 0

    def _all(self, action: str, **fields: Any) -> list[dict[str, Any]]:
        for w in self.workers:
            w.send("ipc", action=action, **fields)
        replies = [w.reply(TIMEOUT_S) for w in self.workers]
        for reply in replies:
            if not reply["ok"]:
                raise RuntimeError(f"{reply['error']}: {reply['message']}")
        return replies

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init", init_info=init_info, uuid=None)

    def start_weight_update(self) -> None:
        self._all("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.updates += 1
        self._all("update", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish")


@pytest.fixture
def runtime() -> Iterator[CpuSimRuntime]:
    rt = CpuSimRuntime()
    yield rt
    rt.close()


def _init(workers: list[WorkerProcess], uuids: list[str], init_info: dict[str, Any]) -> None:
    for w, uuid in zip(workers, uuids, strict=True):
        reply = w.call("ipc", action="init", init_info=init_info, uuid=uuid)
        assert reply["ok"] and reply["uuid"] == uuid, reply


@pytest.mark.parametrize(("packed", "buffer"), [(True, 1000), (True, 1 << 20), (False, 1 << 20)])
def test_three_updates_are_loaded_on_every_worker(
    spawn_workers: Callable[..., list[WorkerProcess]], runtime: CpuSimRuntime, packed: bool, buffer: int
) -> None:
    workers = spawn_workers(2, SPECS)
    client = ProcessClient(workers)
    trainer = IpcTrainer(client, runtime, packed=packed, buffer_size_bytes=buffer, uuid="host-cpu0")
    init = {"packed": packed, "buffer_size_bytes": buffer}
    _init(workers, ["host-cpu0", "host-cpu0"], init)  # both colocated with the one trainer chip
    for seed in (1, 2, 3):
        weights = synthetic_weights(SPECS, seed)
        sent = trainer.send(weights)
        expected = param_digests(weights)
        for w in workers:
            assert w.call("digest")["digests"] == expected  # loaded, also on the packed path
    assert sent == (1 if not packed else -(-sum(t.numel() * t.element_size() for _, t in weights) // buffer))


def test_worker_on_another_chip_is_refused_and_keeps_weights(
    spawn_workers: Callable[..., list[WorkerProcess]], runtime: CpuSimRuntime
) -> None:
    (worker,) = spawn_workers(1, SPECS)
    client = ProcessClient([worker])
    trainer = IpcTrainer(client, runtime, packed=True, buffer_size_bytes=4096, uuid="host-cpu0")
    _init([worker], ["host-cpu1"], {"packed": True, "buffer_size_bytes": 4096})
    before = worker.call("digest")["digests"]
    with pytest.raises(RuntimeError, match=r"ConfigError.*host-cpu1.*same chip"):
        trainer.send(synthetic_weights(SPECS, 1))
    assert worker.call("digest")["digests"] == before


def test_packed_mismatch_with_worker_init_is_a_typed_error(
    spawn_workers: Callable[..., list[WorkerProcess]], runtime: CpuSimRuntime
) -> None:
    (worker,) = spawn_workers(1, SPECS)
    trainer = IpcTrainer(ProcessClient([worker]), runtime, packed=True, buffer_size_bytes=4096, uuid="h-cpu0")
    _init([worker], ["h-cpu0"], {"packed": True, "buffer_size_bytes": 8192})
    with pytest.raises(RuntimeError, match=r"ManifestMismatch: buffer_size_bytes: worker has 8192, trainer sent 4096"):
        trainer.send(synthetic_weights(SPECS, 1))
    trainer.init()  # the trainer re-sends its parameters: the session starts over
    trainer.send(synthetic_weights(SPECS, 2))
    assert worker.call("digest")["digests"] == param_digests(synthetic_weights(SPECS, 2))


class ThreadExchange:
    """A `HandleExchange` between trainer ranks that are threads of this process."""

    def __init__(self, rank: int, world_size: int, shared: dict[str, Any]) -> None:
        self.rank, self.world_size, self._shared = rank, world_size, shared

    def all_gather(self, payload: bytes) -> list[bytes]:
        slots = self._shared["slots"]
        slots[self.rank] = payload
        self._shared["barrier"].wait(TIMEOUT_S)
        out = list(slots)
        self._shared["barrier"].wait(TIMEOUT_S)
        return out

    def barrier(self) -> None:
        self._shared["barrier"].wait(TIMEOUT_S)


def test_two_trainer_ranks_merge_handles_and_each_worker_reads_its_own_chip(
    spawn_workers: Callable[..., list[WorkerProcess]],
) -> None:
    workers = spawn_workers(2, SPECS)
    client = ProcessClient(workers)
    _init(workers, ["h-cpu0", "h-cpu1"], {"packed": False, "buffer_size_bytes": 1 << 20})
    shared: dict[str, Any] = {"slots": [b"", b""], "barrier": threading.Barrier(2)}
    errors: list[BaseException] = []
    runtimes = [CpuSimRuntime(), CpuSimRuntime()]

    def rank_main(rank: int) -> None:
        try:  # each rank shares its own copy (different values here, to see who reads which)
            trainer = IpcTrainer(client, runtimes[rank], packed=False, uuid=f"h-cpu{rank}",
                                 exchange=ThreadExchange(rank, 2, shared))  # fmt: skip
            trainer.send(synthetic_weights(SPECS, 10 + rank))
        except BaseException as exc:
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S * 2)
        assert not errors, errors
        for rank, w in enumerate(workers):
            assert w.call("digest")["digests"] == param_digests(synthetic_weights(SPECS, 10 + rank))
    finally:
        for rt in runtimes:
            rt.close()


def test_streamed_ipc_updates_load_chunk_by_chunk_on_every_worker(
    spawn_workers: Callable[..., list[WorkerProcess]], runtime: CpuSimRuntime
) -> None:
    workers = spawn_workers(2, SPECS)
    client = ProcessClient(workers)
    buffer = 8192  # the largest tensor is ~5 KiB; the model ~48 KiB: several buckets
    trainer = IpcTrainer(client, runtime, packed=True, buffer_size_bytes=buffer, uuid="host-cpu0", streamed=True)
    _init(workers, ["host-cpu0", "host-cpu0"], {"packed": True, "buffer_size_bytes": buffer, "streamed": True})
    previous: dict[str, str] | None = None
    for seed in (1, 2):
        weights = synthetic_weights(SPECS, seed)
        sent = trainer.send(weights)
        expected = param_digests(weights)
        assert sent >= 5
        for w in workers:
            got = w.call("digest")["digests"]
            assert got == expected
            if previous is not None:  # control: every tensor changed
                assert all(got[n] != previous[n] for n in got)
        previous = expected


def test_a_streamed_ipc_trainer_dying_midway_leaves_a_truthful_mixed_weights_error(
    spawn_workers: Callable[..., list[WorkerProcess]], runtime: CpuSimRuntime
) -> None:
    (worker,) = spawn_workers(1, SPECS)
    client = ProcessClient([worker])
    trainer = IpcTrainer(client, runtime, packed=True, buffer_size_bytes=8192, uuid="host-cpu0", streamed=True)
    _init([worker], ["host-cpu0"], {"packed": True, "buffer_size_bytes": 8192, "streamed": True})
    weights = synthetic_weights(SPECS, 5)

    def dies_midway() -> Iterator[tuple[str, Any]]:
        for i, item in enumerate(weights):
            if i == len(weights) // 2:
                raise OSError("trainer died")
            yield item

    manifest = trainer_manifest(weights)
    with pytest.raises(OSError, match="trainer died"):
        trainer.send(dies_midway(), manifest)
    with pytest.raises(RuntimeError, match=r"LoadFailed: finish after \d+ of \d+ streamed chunks.*mixed weights"):
        client.finish_weight_update()
    now, new = worker.call("digest")["digests"], param_digests(weights)
    assert any(now[n] == new[n] for n in now) and any(now[n] != new[n] for n in now)  # mixed, as it says


def trainer_manifest(weights: list[tuple[str, Any]]) -> Any:
    from ascend_dist.weight_transfer.trainer import manifest_of

    return manifest_of(weights, buffer_size_bytes=8192, num_buffers=1, streamed=True)
