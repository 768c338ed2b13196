"""npu_ipc with several trainer ranks: a failure on one rank reaches every rank at once, never a hang.

Issue 25 item 4 ("every wait bounded, every error surfaced with its cause"). Two trainer ranks run as
threads of this process with a `HandleExchange` between them whose waits give up only after
`EXCHANGE_S` (standing in for torch.distributed's 30-minute default); one worker (`IpcWorker`, shared
memory) is driven directly by the sender's client. Before the fix, the rank that did not fail waited
in the exchange until that deadline and then raised an error without the cause.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from ascend_dist.common.device import CpuSimRuntime
from ascend_dist.common.errors import AscendDistError
from ascend_dist.weight_transfer._demo.procs import param_digests, synthetic_specs, synthetic_weights
from ascend_dist.weight_transfer.errors import UpdateAborted
from ascend_dist.weight_transfer.ipc_trainer import IpcTrainer
from ascend_dist.weight_transfer.ipc_worker import IpcWorker
from ascend_dist.weight_transfer.messages import IpcParams
from ascend_dist.weight_transfer.session import ModuleSink
from ascend_dist.weight_transfer.trainer import manifest_of

SPECS = synthetic_specs(10, 30 * 1024, dtypes=("float32", "bfloat16"))
BUFFER = 8192
EXCHANGE_S = 30.0
PROMPT_S = 5.0  # a failure must reach every rank well within this


class ThreadExchange:
    """A `HandleExchange` between trainer ranks that are threads of this process."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        self.rank, self.world_size, self._shared = rank, 2, shared

    def all_gather(self, payload: bytes) -> list[bytes]:
        slots = self._shared["slots"]
        slots[self.rank] = payload
        self._shared["barrier"].wait(EXCHANGE_S)
        out = list(slots)
        self._shared["barrier"].wait(EXCHANGE_S)
        return out

    def barrier(self) -> None:
        self._shared["barrier"].wait(EXCHANGE_S)


class Client:
    """The sender's `WeightSyncClient`, calling the worker directly; ``refuse_at`` fails that update call."""

    def __init__(self, worker: IpcWorker) -> None:
        self.worker, self.updates, self.refuse_at = worker, 0, -1

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.worker.init(msgspec.convert(init_info, IpcParams))

    def start_weight_update(self) -> None:
        self.worker.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.updates += 1
        if self.updates - 1 == self.refuse_at:
            raise RuntimeError("the engine refused the update: worker 0 is out of memory")
        self.worker.update(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.worker.finish()


def _model() -> torch.nn.Module:
    module = torch.nn.Module()
    for name, dtype, shape in SPECS:
        module.register_parameter(
            name.replace(".", "_"),
            torch.nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype)), requires_grad=False),
        )
    return module


class Sink(ModuleSink):
    def load_weights(self, weights: Any) -> set[str]:
        return super().load_weights((n.replace(".", "_"), t) for n, t in weights)


def _run_ranks(
    streamed: bool, sources: list[Any], client_setup: Any = None
) -> tuple[list[BaseException | None], list[float], Client, Sink]:
    runtimes = [CpuSimRuntime(), CpuSimRuntime()]
    sink = Sink(_model())
    worker = IpcWorker(sink, runtimes[0], uuid="h-cpu0")
    client = Client(worker)
    if client_setup is not None:
        client_setup(client)
    shared: dict[str, Any] = {"slots": [b"", b""], "barrier": threading.Barrier(2)}
    errors: list[BaseException | None] = [None, None]
    took = [0.0, 0.0]
    manifest = manifest_of(synthetic_weights(SPECS, 1), packed=True, buffer_size_bytes=BUFFER, num_buffers=1,
                           streamed=streamed)  # fmt: skip

    def rank_main(rank: int) -> None:
        trainer = IpcTrainer(client, runtimes[rank], packed=True, buffer_size_bytes=BUFFER, uuid=f"h-cpu{rank}",
                             exchange=ThreadExchange(rank, shared), streamed=streamed)  # fmt: skip
        trainer.init()
        t0 = time.monotonic()
        try:
            trainer.send(sources[rank](), manifest)
        except BaseException as exc:
            errors[rank] = exc
        took[rank] = time.monotonic() - t0

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(EXCHANGE_S * 3)
        assert not any(t.is_alive() for t in threads)
    finally:
        for rt in runtimes:
            rt.close()
    return errors, took, client, sink


def _good(seed: int) -> Any:
    return lambda: iter(synthetic_weights(SPECS, seed))


def _dies_midway() -> Iterator[tuple[str, torch.Tensor]]:
    weights = synthetic_weights(SPECS, 2)
    for i, item in enumerate(weights):
        if i == len(weights) // 2:
            raise OSError("trainer rank 1 lost its parameter shard")
        yield item


@pytest.mark.parametrize("streamed", [False, True])
def test_the_senders_rpc_failure_reaches_the_other_trainer_rank_at_once(streamed: bool) -> None:
    errors, took, _, _ = _run_ranks(streamed, [_good(1), _good(2)], lambda c: setattr(c, "refuse_at", 1))
    assert isinstance(errors[0], RuntimeError) and "out of memory" in str(errors[0])  # the sender: the RPC's error
    assert isinstance(errors[1], UpdateAborted), errors[1]  # before: BrokenBarrierError after EXCHANGE_S
    assert "trainer rank 0" in str(errors[1]) and "out of memory" in str(errors[1])
    assert max(took) < PROMPT_S, took


@pytest.mark.parametrize("streamed", [False, True])
def test_a_trainer_rank_failing_midway_stops_the_sender_before_its_next_rpc(streamed: bool) -> None:
    errors, took, client, _ = _run_ranks(streamed, [_good(1), _dies_midway])
    assert isinstance(errors[1], OSError), errors[1]  # that rank: its own error
    assert isinstance(errors[0], UpdateAborted), errors[0]  # before: BrokenBarrierError after EXCHANGE_S
    assert "trainer rank 1" in str(errors[0]) and "lost its parameter shard" in str(errors[0])
    assert max(took) < PROMPT_S, took
    assert client.updates < 5  # the sender stopped at the failing chunk


def test_every_trainer_rank_succeeds_together() -> None:  # the control: the same harness, no failure
    errors, _, _, sink = _run_ranks(True, [_good(3), _good(4)])
    assert errors == [None, None], errors
    want = {n.replace(".", "_"): d for n, d in param_digests(synthetic_weights(SPECS, 3)).items()}
    assert param_digests(sorted(sink.module.named_parameters())) == dict(sorted(want.items()))  # rank 0's copy


def _one_too_many() -> Iterator[tuple[str, torch.Tensor]]:
    yield from synthetic_weights(SPECS, 2)
    yield "extra.weight", torch.ones(4)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_trainer_rank_whose_source_has_more_tensors_stops_the_finish(streamed: bool) -> None:
    """Its source fails only after the last chunk: the sender must learn it before calling finish."""
    finished: list[bool] = []

    def setup(client: Client) -> None:
        finish = client.finish_weight_update
        client.finish_weight_update = lambda weight_version=None: (finished.append(True), finish())  # type: ignore[method-assign]

    errors, took, _, _ = _run_ranks(streamed, [_good(1), _one_too_many], setup)
    assert isinstance(errors[1], AscendDistError), errors[1]
    assert isinstance(errors[0], UpdateAborted) and "trainer rank 1" in str(errors[0]), errors[0]
    assert not finished  # the engines were never told the update is complete
    assert max(took) < PROMPT_S, took
