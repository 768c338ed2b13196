"""RL weight updates into a running vLLM engine: a trainer process pushes model "b"'s weights.

Checks, per backend (``hccl``: gloo broadcast on the CPU; ``npu_ipc``: shared memory on the CPU):
a trainer killed after the manifest and its first buffer leaves the engine serving "a"'s weights
(outputs equal the "a" reference) with a typed error within a deadline; then a fresh trainer
updates the same engine to "b": its outputs equal an engine started on "b" and differ from every
output before (the control: before the update the engine equals the "a" reference).

The trainer (`weight_trainer.py`) is a separate process with torch and our trainer classes only;
it calls vLLM's four weight-sync methods through a relay on its stdio, which this module forwards
to the engine's `LLM` (`Engine.weight_sync`), while the weights move trainer -> engine directly.
vLLM 0.32's CPU build has the whole offline API (``LLM.init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``); our engines are registered
by the meta-package's vLLM plugin and selected by ``weight_transfer_config={"backend": ...}``.
"""

from __future__ import annotations

import contextlib
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ascend_dist.cli.engines.host import Engine, EngineError, EngineHost, WeightSyncError
from ascend_dist.cli.engines.wire import WEIGHT_SYNC_METHODS, Completion, EngineSpec, WeightSync
from ascend_dist.testing.engines import (
    assert_every_output_differs,
    assert_same_output,
    free_port_base,
    local,
    make_prompts,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

HELPER = Path(__file__).resolve().parent / "weight_trainer.py"
BUFFER = 256 << 10  # the tiny model (~3 MiB) spans ~12 buffers, so "after the first buffer" is mid-update
OP_TIMEOUT_S = 60.0  # the collective's deadline on both sides (a dead peer usually fails it sooner)
FAILURE_DEADLINE_S = 90.0  # a killed trainer's update must have failed in the engine by then


@dataclass
class Call:
    """One weight-sync call the trainer made, as relayed to the engine."""

    method: str
    seconds: float
    ended: float  # time.monotonic() when the engine answered
    error: WeightSyncError | None


class TrainerProcess:
    """The trainer process and the relay thread that forwards its weight-sync calls to ``engine``."""

    def __init__(self, engine: Engine, config: dict[str, Any], log: Path) -> None:
        self.engine = engine
        self.calls: list[Call] = []
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._log = open(log, "ab")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPER), msgspec.json.encode(config).decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )
        self._calls: list[threading.Thread] = []  # one at a time: the trainer waits for each answer
        self._relay = threading.Thread(target=self._serve, name="trainer-relay", daemon=True)
        self._relay.start()

    def _serve(self) -> None:
        """Read the trainer's lines: events are queued at once, calls run on their own thread.

        A call (e.g. ``update_weights`` while the trainer broadcasts) can block for as long as the
        transfer runs, and the trainer's events must still get through meanwhile.
        """
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = msgspec.json.decode(line)
            if "event" in message:
                self._events.put(message)
                continue
            call = threading.Thread(target=self._execute, args=(message,), name="trainer-call", daemon=True)
            self._calls.append(call)
            call.start()
        self._events.put({"event": "eof"})

    def _execute(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        method, args = message["call"], message.get("args", {})
        if method not in WEIGHT_SYNC_METHODS:
            answer: dict[str, Any] = {"ok": False, "error": f"unknown method {method!r}"}
        else:
            start, error = time.monotonic(), None
            try:
                getattr(self.engine.weight_sync, method)(**args)
            except WeightSyncError as exc:
                error = exc
            self.calls.append(Call(method, time.monotonic() - start, time.monotonic(), error))
            answer = {"ok": error is None, "error": None if error is None else error.reason}
        with contextlib.suppress(BrokenPipeError, ValueError):  # the trainer may be dead by now
            self.proc.stdin.write(msgspec.json.encode(answer) + b"\n")
            self.proc.stdin.flush()

    def wait_event(self, name: str, timeout_s: float) -> dict[str, Any]:
        """The trainer's next event, which must be ``name`` (a "failed" one raises with its error)."""
        try:
            event = self._events.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"the trainer sent no {name!r} within {timeout_s} s; calls: {self.calls}") from None
        assert event["event"] == name, f"expected {name!r} from the trainer, got {event}; calls: {self.calls}"
        return event

    def kill(self) -> float:
        """SIGKILL the trainer; returns when it died (time.monotonic())."""
        self.proc.kill()
        self.proc.wait(timeout=30)
        return time.monotonic()

    def wait_relay(self, timeout_s: float) -> None:
        """Wait until the relay finished: the trainer hung up and the engine answered every call."""
        deadline = time.monotonic() + timeout_s
        self._relay.join(timeout_s)
        for call in list(self._calls):
            call.join(max(0.0, deadline - time.monotonic()))
        busy = self._relay.is_alive() or any(c.is_alive() for c in self._calls)
        assert not busy, f"the engine did not answer the dead trainer's call within {timeout_s} s"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.wait_relay(FAILURE_DEADLINE_S)
        for stream in (self.proc.stdin, self.proc.stdout, self._log):
            with contextlib.suppress(OSError, AttributeError):
                stream.close()  # type: ignore[union-attr]


def safetensors_of(model: Path) -> str:
    files = sorted(model.glob("*.safetensors"))
    assert len(files) == 1, f"expected one safetensors file in {model}, got {files}"
    return str(files[0])


@contextlib.contextmanager
def trainer(engine: Engine, models: dict[str, Path], tmp_path: Path, **config: Any) -> Iterator[TrainerProcess]:
    full = {"weights": safetensors_of(models["b"]), "buffer_size_bytes": BUFFER, "op_timeout_s": OP_TIMEOUT_S}
    full.update(port=free_port_base(1), **config)
    process = TrainerProcess(engine, full, tmp_path / f"trainer-{config['backend']}.log")
    try:
        yield process
    finally:
        process.close()


@pytest.fixture(scope="module")
def reference_b(host: EngineHost, models: dict[str, Path]) -> Iterator[Engine]:
    """An engine started on "b": what a full update must reproduce."""
    engine = host.spawn(EngineSpec(model=str(models["b"])), "reference-b")
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["hccl", "npu_ipc"])
def updatable(request: pytest.FixtureRequest, host: EngineHost, models: dict[str, Path]) -> Iterator[Engine]:
    """An engine on "a" that accepts weight updates through our ``hccl`` / ``npu_ipc`` engine."""
    backend = request.param
    spec = EngineSpec(model=str(models["a"]), weight_transfer_config={"backend": backend})
    engine = host.spawn(spec, f"weights-{backend}")
    yield engine
    engine.close()


def backend_of(engine: Engine) -> str:
    assert engine.spec.weight_transfer_config is not None
    return str(engine.spec.weight_transfer_config["backend"])


def outputs(engine: Engine, prompts: list[list[int]]) -> list[Completion]:
    return engine.generate(local(prompts))


@pytest.mark.parametrize(
    ("message", "names"),
    [
        (
            WeightSync("collective_rpc", {"method": "execute_model"}),
            r"Invalid enum value 'collective_rpc' - at `\$\.method`",
        ),  # type: ignore[arg-type]
        (WeightSync("update_weights", None), "'update_info'"),
        (WeightSync("init_weight_transfer_engine", {"info": {}}), "'init_info'"),
        (WeightSync("start_weight_update", {"x": 1}), "takes no request"),
        (
            WeightSync("init_weight_transfer_engine", {"init_info": {"no_such_field": 1}}),
            "Invalid init_info.*no_such_field",
        ),
    ],
    ids=["unknown-method", "update-without-info", "init-wrong-key", "start-with-request", "init-bad-fields"],
)
def test_hostile_weight_sync_message_is_a_typed_failure_and_the_engine_serves(
    updatable: Engine, reference: Engine, message: WeightSync, names: str
) -> None:
    """A message outside the whitelist or with a malformed request fails naming the field; nothing changes."""
    with pytest.raises(WeightSyncError, match=names):
        updatable.call_weight_sync(message)
    prompts = make_prompts(931)
    assert_same_output(outputs(updatable, prompts), outputs(reference, prompts))


def test_trainer_killed_mid_update_leaves_old_weights(
    updatable: Engine, models: dict[str, Path], reference: Engine, tmp_path: Path
) -> None:
    """Killed after the manifest and one buffer: a typed error within the deadline, "a" still served."""
    backend = backend_of(updatable)
    prompts = make_prompts(911)
    want_a = outputs(reference, prompts)
    assert_same_output(outputs(updatable, prompts), want_a)  # precondition: the engine serves "a"
    with trainer(updatable, models, tmp_path, backend=backend, pause_after_buffers=1, weight_version="dead") as t:
        t.wait_event("paused", 120.0)
        died = t.kill()
        if backend == "hccl":
            # the engine is inside update_weights, waiting for buffer 2 of a dead peer
            t.wait_relay(FAILURE_DEADLINE_S)
            failed = [c for c in t.calls if c.error is not None]
            assert [c.method for c in failed] == ["update_weights"], t.calls
            error = failed[0].error
            assert error is not None and "UpdateAborted" in error.reason, error
            took = failed[0].ended - died
        else:
            # IPC: the engine applied chunk 0 and waits for more; the controller closes the update
            t.wait_relay(FAILURE_DEADLINE_S)
            assert [c.method for c in t.calls] == [
                "init_weight_transfer_engine",
                "start_weight_update",
                "update_weights",
            ]
            assert all(c.error is None for c in t.calls), t.calls
            start = time.monotonic()
            with pytest.raises(WeightSyncError, match="was not loaded") as info:
                updatable.weight_sync.finish_weight_update("dead")
            error, took = info.value, time.monotonic() - start
            # vLLM keeps its session open after a failed finish; a second one (no version) closes it
            updatable.weight_sync.finish_weight_update()
            assert updatable.weight_sync.last_weight_version != "dead"
        assert took < FAILURE_DEADLINE_S, f"the failure took {took:.1f} s"
        print(f"{backend}: trainer killed mid-update -> {error.method} failed after {took:.1f} s: {error.reason}")
    assert updatable.alive
    assert_same_output(outputs(updatable, make_prompts(912)), outputs(reference, make_prompts(912)))
    assert_same_output(outputs(updatable, prompts), want_a)


@pytest.mark.parametrize("corrupt", ["name", "shape"])
def test_bad_update_leaves_the_old_weights(
    updatable: Engine, models: dict[str, Path], reference: Engine, tmp_path: Path, corrupt: str
) -> None:
    """The last tensor under a name the model lacks, or one row too long: refused, "a" still served.

    The good tensors come first, so an engine that loaded as it went and failed at the bad one would
    serve a mix of "a" and "b" (the outputs would match neither reference).
    """
    backend = backend_of(updatable)
    prompts = make_prompts(941)
    want_a = outputs(reference, prompts)
    assert_same_output(outputs(updatable, prompts), want_a)  # precondition: the engine serves "a"
    version = f"bad-{corrupt}"
    with trainer(updatable, models, tmp_path, backend=backend, corrupt=corrupt, weight_version=version) as t:
        try:
            end = t.wait_event("failed", 240.0)
        except AssertionError as exc:  # "done": the engine accepted the bad update
            raise AssertionError(f"{backend}: the bad update ({corrupt}) was accepted: {exc}") from None
        t.wait_event("eof", 60.0)
        t.wait_relay(FAILURE_DEADLINE_S)
    failed = [c for c in t.calls if c.error is not None]
    assert failed, f"no weight-sync call failed; the trainer said {end}"
    print(f"{backend}: bad {corrupt} -> {failed[0].method} failed: {failed[0].error}")
    if updatable.weight_sync.last_weight_version == version:
        raise AssertionError(f"the engine took weight version {version!r} for a refused update")
    if any(c.method == "start_weight_update" for c in t.calls) and not any(
        c.method == "finish_weight_update" for c in t.calls
    ):
        with contextlib.suppress(WeightSyncError):  # close vLLM's session, as after a killed trainer
            updatable.weight_sync.finish_weight_update()
    assert updatable.alive
    assert_same_output(outputs(updatable, prompts), want_a)
    assert_same_output(outputs(updatable, make_prompts(942)), outputs(reference, make_prompts(942)))


def test_trainer_updates_engine_to_other_weights(
    updatable: Engine, models: dict[str, Path], reference: Engine, reference_b: Engine, tmp_path: Path
) -> None:
    """A full update to "b" (on the engine a killed trainer left behind): equal to an engine on "b"."""
    backend = backend_of(updatable)
    prompts = make_prompts(921)
    before = outputs(updatable, prompts)
    assert_same_output(before, outputs(reference, prompts))  # the control's baseline: the engine serves "a"
    with trainer(updatable, models, tmp_path, backend=backend, weight_version="b-1") as t:
        done = t.wait_event("done", 240.0)
        t.wait_event("eof", 30.0)
    assert done["vllm_imported"] is False, "the trainer side must not import vLLM"
    methods = [c.method for c in t.calls]  # vLLM's call order: init, start, update(s), finish
    assert methods[:2] == ["init_weight_transfer_engine", "start_weight_update"], methods
    assert methods[-1] == "finish_weight_update" and set(methods[2:-1]) == {"update_weights"}, methods
    assert all(c.error is None for c in t.calls), t.calls
    assert updatable.weight_sync.last_weight_version == "b-1"
    after = outputs(updatable, prompts)
    # vLLM's counter: no KV computed under "a" answered these prompts (the harness resets the prefix
    # cache after finish_weight_update, as RL frameworks do; without it 320 of 333 tokens were reused)
    assert [c.num_cached_tokens for c in after] == [0] * len(prompts)
    assert_same_output(after, outputs(reference_b, prompts))
    assert_every_output_differs(after, before)
    print(f"{backend}: update of {done['tensors']} tensors in {len(methods)} calls ({len(methods) - 3} update_weights)")


def test_trainer_killed_mid_stream_makes_the_engine_refuse_to_generate(
    host: EngineHost, models: dict[str, Path], reference: Engine, tmp_path: Path
) -> None:
    """Streamed (``hccl``, ``streamed=true``): killed after one bucket was loaded, the engine holds a mix of "a"
    and "b". Its update fails with `PartialUpdate`, and the next generation must fail naming
    `WeightsInconsistent` instead of answering from mixed weights. In vLLM a forward that raises fails
    the engine core's step: a separate engine-core process dies (vLLM reports the engine dead); this
    tier's in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) raises it from ``generate``.
    Not updated again here: with ``layerwise_reload=false`` vLLM's CPU build cannot load new weights
    into its packed GEMM weights, so no later output could be compared with "b".

    Its own engine (it does not survive); never run on this VM yet (written 2026-12-04, see the README).
    """
    spec = EngineSpec(model=str(models["a"]), weight_transfer_config={"backend": "hccl"})
    engine = host.spawn(spec, "weights-hccl-streamed")
    try:
        prompts = make_prompts(951)
        assert_same_output(outputs(engine, prompts), outputs(reference, prompts))  # precondition: "a"
        with trainer(engine, models, tmp_path, backend="hccl", streamed=True, pause_after_buffers=1,
                     weight_version="mixed") as t:  # fmt: skip
            t.wait_event("paused", 120.0)
            t.kill()
            t.wait_relay(FAILURE_DEADLINE_S)
        failed = [c for c in t.calls if c.error is not None]
        assert [c.method for c in failed] == ["update_weights"], t.calls
        assert failed[0].error is not None and "PartialUpdate" in failed[0].error.reason, failed[0].error
        with contextlib.suppress(WeightSyncError):  # close vLLM's session if the failed update left it open
            engine.weight_sync.finish_weight_update()
        assert engine.weight_sync.last_weight_version != "mixed"
        with pytest.raises(EngineError) as refused:
            got = outputs(engine, prompts)
            raise AssertionError(f"the engine generated from mixed weights: {got}")
        log = engine.log_path.read_text(errors="replace")
        assert "WeightsInconsistent" in str(refused.value) or "WeightsInconsistent" in log, refused.value
        print(f"hccl streamed: trainer killed mid-stream -> {failed[0].error.reason[:160]}; generate refused")
    finally:
        engine.close()
