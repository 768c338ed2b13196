"""A loader that fails after the commit vote: every rank learns it, and every rank restores its previous weights.

Issue 25 item 4. The trainer and 2 workers run as threads of this process over one real gloo group;
one worker's sink is a fake of our own `WeightSink` Protocol (`flat_model.FailingSink`) whose loader
raises half-way through an update (as vLLM's ``load_weights`` does on a name or shape its loader
refuses), after it wrote some parameters.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from ascend_dist.weight_transfer._demo.procs import param_digests, synthetic_weights
from ascend_dist.weight_transfer.errors import LoadFailed, LoadRestored, UpdateAborted
from ascend_dist.weight_transfer.session import ModuleSink, Snapshot
from ascend_dist.weight_transfer.trainer import BroadcastTrainer
from ascend_dist.weight_transfer.worker import BroadcastWorker

from .conftest import free_port
from .flat_model import SPECS, FailingSink, Model, digests, want

TIMEOUT_S = 20.0


def _group(sinks: list[FailingSink]) -> tuple[BroadcastTrainer, list[BroadcastWorker], ThreadPoolExecutor]:
    port = free_port()
    pool = ThreadPoolExecutor(max_workers=len(sinks) + 1)
    workers = [BroadcastWorker(sink) for sink in sinks]
    joins = [
        pool.submit(w.init, master_address="127.0.0.1", master_port=port, rank=r + 1, world_size=len(sinks) + 1,
                    buffer_size_bytes=8192, op_timeout_s=TIMEOUT_S)
        for r, w in enumerate(workers)
    ]  # fmt: skip
    trainer = BroadcastTrainer.connect(
        "127.0.0.1", port, len(sinks) + 1, buffer_size_bytes=8192, op_timeout_s=TIMEOUT_S
    )
    for join in joins:
        join.result(TIMEOUT_S)
    return trainer, workers, pool


def _update(
    trainer: BroadcastTrainer, workers: list[BroadcastWorker], pool: ThreadPoolExecutor, seed: int
) -> tuple[BaseException | None, list[BaseException | None]]:
    names, dtypes, shapes = [s[0] for s in SPECS], [s[1] for s in SPECS], [list(s[2]) for s in SPECS]
    outcomes: list[Future[object]] = []
    for w in workers:
        w.start()
        outcomes.append(pool.submit(w.update, names, dtypes, shapes))
    try:
        trainer.send(synthetic_weights(SPECS, seed))
        sent: BaseException | None = None
    except Exception as exc:
        sent = exc
    errors = [f.exception(TIMEOUT_S) for f in outcomes]
    for w in workers:
        if w.session.state.value == "active":
            w.finish()
    return sent, errors


def _close(trainer: BroadcastTrainer, workers: list[BroadcastWorker], pool: ThreadPoolExecutor) -> None:
    trainer.shutdown()
    for w in workers:
        w.shutdown()
    pool.shutdown(wait=True)


def test_a_loader_failure_after_the_vote_restores_every_rank_and_every_rank_reports_it() -> None:
    sinks = [FailingSink(Model(1)), FailingSink(Model(1), fail_after=len(SPECS) // 2)]
    trainer, workers, pool = _group(sinks)
    try:
        before = [digests(s.module) for s in sinks]
        sent, errors = _update(trainer, workers, pool, seed=2)
        # the trainer and both workers report it; today the trainer and worker 1 reported success
        assert isinstance(sent, LoadRestored) and "ranks [2]" in str(sent), sent
        assert all(isinstance(e, LoadRestored) for e in errors), errors
        assert isinstance(errors[1].__cause__, KeyError)  # the loader's own error, on the rank it happened
        assert isinstance(sent, UpdateAborted)  # "the model keeps its previous weights"
        assert [digests(s.module) for s in sinks] == before  # worker 1 loaded everything and rolled back; worker 2 half
        sinks[1].fail_after = None  # control: the same group takes the next update on every rank
        sent, errors = _update(trainer, workers, pool, seed=3)
        assert sent is None and errors == [None, None], (sent, errors)
        assert all(digests(s.module) == want(3) for s in sinks)
    finally:
        _close(trainer, workers, pool)


def test_without_a_restore_point_every_rank_reports_mixed_weights() -> None:
    sinks = [FailingSink(Model(1), restore=False), FailingSink(Model(1), fail_after=3, restore=False)]
    trainer, workers, pool = _group(sinks)
    try:
        sent, errors = _update(trainer, workers, pool, seed=2)
        assert isinstance(sent, LoadFailed) and not isinstance(sent, UpdateAborted), sent
        assert "ranks [1, 2]" in str(sent) and "mixed" in str(sent), sent
        assert all(isinstance(e, LoadFailed) and not isinstance(e, UpdateAborted) for e in errors), errors
    finally:
        _close(trainer, workers, pool)


@pytest.mark.parametrize("tied", [False, True])
def test_module_snapshot_restores_values_and_the_parameter_objects(tied: bool) -> None:
    module = Model(1)
    if tied:
        module.register_parameter("tied", module.p0)  # one Parameter under two names (embedding / lm_head)
    params = dict(module.named_parameters(remove_duplicate=False))
    before = param_digests(sorted(params.items()))
    snapshot = ModuleSink(module).snapshot()
    with torch.no_grad():
        module.p1.fill_(7)
        del module._parameters["p2"]
        module.register_parameter("p3", torch.nn.Parameter(torch.zeros(1), requires_grad=False))  # a meta-like stand-in
    snapshot.restore()
    after = dict(module.named_parameters(remove_duplicate=False))
    assert param_digests(sorted(after.items())) == before
    assert all(after[n] is params[n] for n in params)  # the same objects: kernels and graphs keep their pointers
    assert snapshot.nbytes == sum(p.nbytes for p in module.parameters())  # a tied tensor is copied once


def test_snapshots_from_one_sink_reuse_one_host_buffer_and_restore_their_own_values() -> None:
    module = Model(1)
    with torch.no_grad():  # odd byte counts between dtypes, a transposed (non-contiguous) one and a 0-dim one
        module.register_parameter("odd", torch.nn.Parameter(torch.arange(3, dtype=torch.bfloat16), requires_grad=False))
        module.register_parameter("t", torch.nn.Parameter(torch.randn(5, 3).t(), requires_grad=False))
        module.register_buffer("scalar", torch.tensor(2.5, dtype=torch.float64))
    sink = ModuleSink(module)

    def state() -> dict[str, str]:
        return param_digests(sorted([*module.named_parameters(), *module.named_buffers()]))

    first = sink.snapshot()
    first_bytes = sink._restore_pool.get("restore", sink._restore_pool.nbytes, torch.device("cpu")).data_ptr()
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.add_(1)
    changed = state()
    second = sink.snapshot()  # the same host bytes, now holding the changed values
    assert sink._restore_pool.get("restore", sink._restore_pool.nbytes, torch.device("cpu")).data_ptr() == first_bytes
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.zero_()
    second.restore()
    assert state() == changed  # not the zeros, not the values of the first snapshot
    assert first is not second


def test_a_restore_point_that_cannot_be_taken_does_not_stop_the_update_and_a_failed_load_names_it() -> None:
    class NoHostMemory(FailingSink):
        def snapshot(self) -> Snapshot | None:
            raise MemoryError("cannot allocate the host copy")

    sinks = [NoHostMemory(Model(1)), NoHostMemory(Model(1))]
    trainer, workers, pool = _group(sinks)
    try:
        sent, errors = _update(trainer, workers, pool, seed=2)  # nothing fails to load: the update lands
        assert sent is None and errors == [None, None], (sent, errors)
        assert all(digests(s.module) == want(2) for s in sinks)
        sinks[1].fail_after = 3
        sent, errors = _update(trainer, workers, pool, seed=3)
        assert isinstance(sent, LoadFailed) and "ranks [1, 2]" in str(sent), sent
        assert all(isinstance(e, LoadFailed) and "taking it failed" in str(e) for e in errors), errors
    finally:
        _close(trainer, workers, pool)
