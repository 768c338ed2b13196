"""Updates that cannot corrupt (issue 25 item 4) on the npu_ipc and streamed paths.

- npu_ipc, staged (packed or not): a loader failing half-way is undone from a host restore point
  (`LoadRestored`, the model serves its previous weights); with several ranks loading the same
  update independently (no cross-rank vote on this path) the failing rank restores and refuses to
  run, since its peers may hold the new weights.
- streamed (IPC and broadcast): an update that left mixed weights makes the model refuse every
  forward with `WeightsInconsistent` naming the cause, until a complete update succeeds.

Real parts: shared memory (`CpuSimRuntime`), gloo and a TCPStore (broadcast, workers as threads).
The sinks are fakes of our own `WeightSink` Protocol whose loader can raise after writing some tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
import torch

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.weight_transfer._demo.procs import synthetic_weights
from ascend_dist.weight_transfer.errors import LoadFailed, LoadRestored, WeightsInconsistent
from ascend_dist.weight_transfer.guard import WeightsGuard
from ascend_dist.weight_transfer.ipc_trainer import IpcTrainer
from ascend_dist.weight_transfer.ipc_worker import IpcWorker
from ascend_dist.weight_transfer.messages import IpcParams
from ascend_dist.weight_transfer.trainer import BroadcastTrainer, manifest_of
from ascend_dist.weight_transfer.worker import BroadcastWorker

from .conftest import free_port
from .flat_model import BUFFER, SPECS, FailingSink, Model, digests, want

TIMEOUT_S = 20.0


class DirectClient:
    """A `WeightSyncClient` calling one `IpcWorker` in this process (vLLM's worker does the same calls)."""

    def __init__(self, worker: IpcWorker) -> None:
        self.worker = worker

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.worker.init(msgspec.convert(init_info, IpcParams))

    def start_weight_update(self) -> None:
        self.worker.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.worker.update(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.worker.finish()


@pytest.fixture
def runtime() -> Iterator[CpuSimRuntime]:
    rt = CpuSimRuntime()
    yield rt
    rt.close()


def _ipc(
    runtime: CpuSimRuntime, *, packed: bool = True, streamed: bool = False, peers: int = 1
) -> tuple[IpcTrainer, IpcWorker, FailingSink]:
    sink = FailingSink(Model(1))
    worker = IpcWorker(sink, runtime, uuid="h-cpu0", peers=peers)
    worker.guard.install(sink.module)
    trainer = IpcTrainer(
        DirectClient(worker), runtime, packed=packed, buffer_size_bytes=BUFFER, uuid="h-cpu0", streamed=streamed
    )
    trainer.init()
    return trainer, worker, sink


@pytest.mark.parametrize("packed", [True, False])
def test_ipc_loader_failure_restores_the_previous_weights(runtime: CpuSimRuntime, packed: bool) -> None:
    trainer, _, sink = _ipc(runtime, packed=packed)
    before = digests(sink.module)
    sink.fail_after = len(SPECS) // 2  # half the tensors written, then the loader raises
    with pytest.raises(LoadRestored, match="restored") as caught:
        trainer.send(synthetic_weights(SPECS, 2))
    assert isinstance(caught.value.__cause__, KeyError)  # the loader's own error
    assert digests(sink.module) == before  # today: half new, half old
    sink.module()  # one rank, restored: it serves its previous weights
    sink.fail_after = None  # control: the next update lands
    trainer.send(synthetic_weights(SPECS, 3))
    assert digests(sink.module) == want(3)


def test_ipc_loader_failure_without_a_restore_point_refuses_to_run(runtime: CpuSimRuntime) -> None:
    trainer, _, sink = _ipc(runtime)
    sink.restore = False
    sink.fail_after = 3
    with pytest.raises(LoadFailed, match="mixed"):
        trainer.send(synthetic_weights(SPECS, 2))
    with pytest.raises(WeightsInconsistent, match="KeyError"):
        sink.module()
    sink.fail_after = None
    trainer.send(synthetic_weights(SPECS, 3))
    assert digests(sink.module) == want(3)
    sink.module()  # a complete update: it runs again


def test_ipc_loader_failure_on_one_of_several_ranks_restores_it_and_refuses_to_run(runtime: CpuSimRuntime) -> None:
    trainer, _, sink = _ipc(runtime, peers=2)
    before = digests(sink.module)
    sink.fail_after = 4
    with pytest.raises(LoadFailed, match="other ranks") as caught:
        trainer.send(synthetic_weights(SPECS, 2))
    assert not isinstance(caught.value, LoadRestored)  # the engine as a whole is not back on one version
    assert digests(sink.module) == before  # this rank restored its own part
    with pytest.raises(WeightsInconsistent, match="other ranks"):
        sink.module()
    sink.fail_after = None
    trainer.send(synthetic_weights(SPECS, 3))
    sink.module()


def test_streamed_ipc_trainer_dying_midway_refuses_to_run_until_a_complete_update(runtime: CpuSimRuntime) -> None:
    trainer, worker, sink = _ipc(runtime, streamed=True)
    weights = synthetic_weights(SPECS, 2)

    def dies_midway() -> Iterator[tuple[str, torch.Tensor]]:
        for i, item in enumerate(weights):
            if i == len(weights) // 2:
                raise OSError("trainer died")
            yield item

    manifest = manifest_of(weights, packed=True, buffer_size_bytes=BUFFER, num_buffers=1, streamed=True)
    with pytest.raises(OSError, match="trainer died"):
        trainer.send(dies_midway(), manifest)
    with pytest.raises(LoadFailed, match="mixed weights"):
        worker.finish()
    now = digests(sink.module)
    assert any(now[n] == v for n, v in want(2).items()) and now != want(2)  # mixed indeed: the control
    with pytest.raises(WeightsInconsistent, match=r"finish after \d+ of \d+ streamed chunks"):
        sink.module()  # today: it runs on mixed weights
    trainer.send(synthetic_weights(SPECS, 3))
    assert digests(sink.module) == want(3)
    sink.module()


def test_streamed_ipc_loader_failure_refuses_to_run(runtime: CpuSimRuntime) -> None:
    trainer, _, sink = _ipc(runtime, streamed=True)
    calls = {"n": 0}
    original = sink.load_weights

    def second_bucket_fails(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("quantisation loader: scale shape not supported")
        return original(weights)

    sink.load_weights = second_bucket_fails  # type: ignore[method-assign]
    with pytest.raises(LoadFailed):
        trainer.send(synthetic_weights(SPECS, 2))
    with pytest.raises(WeightsInconsistent, match="quantisation loader"):
        sink.module()
    sink.load_weights = original  # type: ignore[method-assign]
    trainer.send(synthetic_weights(SPECS, 3))
    sink.module()


def test_streamed_broadcast_loader_failure_refuses_to_run_on_every_rank_until_a_complete_update() -> None:
    sinks = [FailingSink(Model(1)), FailingSink(Model(1))]
    port, pool = free_port(), ThreadPoolExecutor(max_workers=3)
    workers = [BroadcastWorker(s) for s in sinks]
    for w, s in zip(workers, sinks, strict=True):
        w.guard.install(s.module)
    geometry = {"buffer_size_bytes": BUFFER, "op_timeout_s": TIMEOUT_S, "streamed": True}
    joins = [pool.submit(w.init, master_address="127.0.0.1", master_port=port, rank=r + 1, world_size=3, **geometry)
             for r, w in enumerate(workers)]  # fmt: skip
    trainer = BroadcastTrainer.connect("127.0.0.1", port, 3, **geometry)
    for join in joins:
        join.result(TIMEOUT_S)
    names, dtypes, shapes = [s[0] for s in SPECS], [s[1] for s in SPECS], [list(s[2]) for s in SPECS]

    def update(seed: int) -> tuple[BaseException | None, list[BaseException | None]]:
        outcomes: list[Future[object]] = []
        for w in workers:
            w.start()
            outcomes.append(pool.submit(w.update, names, dtypes, shapes))
        try:
            trainer.send(synthetic_weights(SPECS, seed))
            sent = None
        except Exception as exc:
            sent = exc
        errors = [f.exception(TIMEOUT_S) for f in outcomes]
        for w in workers:
            if w.session.state.value == "active":
                w.finish()
        return sent, errors

    try:
        sinks[1].fail_after = 1  # rank 2's loader fails on a bucket; rank 1 loads everything: the ranks differ
        sent, errors = update(2)
        assert isinstance(sent, LoadFailed) and all(isinstance(e, LoadFailed) for e in errors), (sent, errors)
        for s in sinks:  # today: both run, one on new weights, the other on a mix
            with pytest.raises(WeightsInconsistent, match="LoadFailed"):
                s.module()
        sinks[1].fail_after = None
        sent, errors = update(3)
        assert sent is None and errors == [None, None], (sent, errors)
        for s in sinks:
            assert digests(s.module) == want(3)
            s.module()
    finally:
        trainer.shutdown()
        for w in workers:
            w.shutdown()
        pool.shutdown(wait=True)


def test_guard_hooks_the_model_and_its_logits_processors_once() -> None:
    class LogitsProcessor(torch.nn.Module):  # vLLM's class name: its forward runs eagerly outside device graphs
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model = Model(1)
    model.logits = LogitsProcessor()
    guard = WeightsGuard()
    guard.install(model)
    guard.install(model)  # idempotent
    guard.trip("a test")
    for call in (model, lambda: model.logits(torch.ones(1))):
        with pytest.raises(WeightsInconsistent, match="a test"):
            call()
    guard.clear()
    model()
    guard.trip("again")
    guard.remove()
    model()  # hooks gone
