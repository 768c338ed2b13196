"""A trainer process for the weight-update tests: loads a model's safetensors with torch and pushes
them into a running vLLM engine through our weight-transfer engines (torch only, never vLLM).

Runs in: its own process (``python weight_trainer.py '<json config>'``, started by
`test_weight_updates`). The engine's control plane is the test process: the trainer calls vLLM's
four weight-sync methods through `RelayClient`, which writes one JSON line per call on stdout and
reads the answer on stdin, as an RL trainer calls vLLM's HTTP client. The test relays each call to
the engine (`Engine.weight_sync`). Data moves trainer -> engine directly: gloo broadcast
(``hccl``) or shared memory (``npu_ipc``).

Config (JSON, argv[1]): ``backend`` ("hccl" | "npu_ipc"), ``weights`` (a safetensors file),
``buffer_size_bytes``, ``port`` and ``op_timeout_s`` (hccl), ``weight_version``, and
``pause_after_buffers`` (None, or N: after N data buffers reached the engine, say "paused" and
wait to be killed: a trainer dying mid-update, killed by the test at a known point), and
``corrupt`` (None, ``"name"`` or ``"shape"``: the last tensor in send order goes under a name the
model lacks, or with one extra row: a bad update whose good tensors come first).

Messages on stdout: ``{"call": method, "args": {...}}`` (answered ``{"ok": true}`` or
``{"ok": false, "error": ...}``), ``{"event": "paused"}``, ``{"event": "done", ...}``,
``{"event": "failed", "error": ...}``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import msgspec

_PAUSE_LIMIT_S = 120.0  # a paused trainer the test forgot to kill still exits


class RelayClient:
    """`WeightSyncClient` over stdio: each call is one JSON line out and one answer in (thread-safe)."""

    def __init__(self, out: IO[bytes], answers: IO[bytes], weight_version: str | None = None) -> None:
        """Write calls to ``out``, read answers from ``answers``; ``weight_version``: what finish commits."""
        self.weight_version = weight_version
        self._out = out
        self._answers = answers
        self._write_lock = threading.Lock()  # whole lines only
        self._call_lock = threading.Lock()  # one call in flight: the answer read next is this call's

    def emit(self, message: dict[str, Any]) -> None:
        """Write one message line (events go out while a call waits for its answer)."""
        with self._write_lock:
            self._out.write(msgspec.json.encode(message) + b"\n")
            self._out.flush()

    def _call(self, method: str, **args: Any) -> None:
        with self._call_lock:
            self.emit({"call": method, "args": args})
            line = self._answers.readline()
        if not line:
            raise RuntimeError(f"{method}: the control plane hung up")
        answer = msgspec.json.decode(line)
        if not answer.get("ok"):
            raise RuntimeError(f"{method} failed in the engine: {answer.get('error')}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """vLLM ``init_weight_transfer_engine``."""
        self._call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        """vLLM ``start_weight_update``."""
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM ``update_weights``."""
        self._call("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """vLLM ``finish_weight_update`` (`IpcTrainer` passes no version: the configured one is used)."""
        self._call("finish_weight_update", weight_version=weight_version or self.weight_version)


def _pause(client: RelayClient) -> None:
    client.emit({"event": "paused"})
    time.sleep(_PAUSE_LIMIT_S)
    os._exit(5)


class _PausingCollective:
    """Delegates to the real collective; after ``after`` data buffers completed, pauses (to be killed).

    Data buffers are the broadcasts after the first vote (the manifest's); the manifest itself and
    the votes pass through untouched, so the engine has the manifest and ``after`` buffers.
    """

    def __init__(self, inner: Any, after: int, client: RelayClient) -> None:
        self._inner = inner
        self._after = after
        self._client = client
        self._voted = False
        self._posted: list[Any] = []
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device

    def broadcast(self, tensor: Any, src: int) -> Any:
        if self._voted and len(self._posted) >= self._after:
            for pending in self._posted:
                pending.wait()  # the engine has received every buffer before the pause
            _pause(self._client)
        pending = self._inner.broadcast(tensor, src)
        if self._voted:
            self._posted.append(pending)
        return pending

    def all_reduce_sum(self, tensor: Any) -> None:
        self._inner.all_reduce_sum(tensor)
        self._voted = True

    def barrier(self) -> None:
        self._inner.barrier()

    def destroy(self) -> None:
        self._inner.destroy()


class _PausingClient:
    """Delegates to the relay; after ``after`` chunks were applied by the engine, pauses (to be killed)."""

    def __init__(self, inner: RelayClient, after: int) -> None:
        self._inner = inner
        self._after = after
        self._updates = 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._inner.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self._inner.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._inner.update_weights(update_info)
        self._updates += 1
        if self._updates >= self._after:
            _pause(self._inner)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._inner.finish_weight_update(weight_version)


def _in_thread(target: Callable[[], None], name: str) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # reported by the joining thread
            errors.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, errors


def _join(thread: threading.Thread, errors: list[BaseException], timeout_s: float) -> None:
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{thread.name} did not return within {timeout_s} s")
    if errors:
        raise errors[0]


def run_hccl(config: dict[str, Any], tensors: list[tuple[str, Any]], client: RelayClient) -> dict[str, Any]:
    """Broadcast: host the group, let the engine join (vLLM's init route, concurrently), send one update."""
    from ascend_dist.weight_transfer.collective import gloo_collective
    from ascend_dist.weight_transfer.trainer import BroadcastTrainer

    port, timeout = int(config["port"]), float(config["op_timeout_s"])
    after = config.get("pause_after_buffers")
    streamed = bool(config.get("streamed", False))
    buffer = int(config["buffer_size_bytes"])
    if streamed:  # a bucket holds whole tensors: at least the largest one, 64-byte aligned
        largest = max(t.numel() * t.element_size() for _, t in tensors)
        buffer = max(buffer, -(-largest // 64) * 64)
    factory = gloo_collective
    if after is not None:

        def factory(group: Any, device: Any) -> Any:
            return _PausingCollective(gloo_collective(group, device), int(after), client)

    init_info = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
        "packed_buffer_size_bytes": buffer,
        "packed_num_buffers": 2,
        "packed_direct_threshold_bytes": 0,
        "op_timeout_s": timeout,
    }
    if streamed:  # our sink cannot run vLLM's layer-wise reload once per bucket yet
        init_info.update(streamed=True, layerwise_reload=False)
    joining, join_errors = _in_thread(lambda: client.init_weight_transfer_engine(init_info), "engine-join")
    trainer = BroadcastTrainer.connect(
        "127.0.0.1", port, 2, device="cpu", collective_factory=factory, op_timeout_s=timeout,
        buffer_size_bytes=buffer, num_buffers=2, direct_threshold_bytes=0, streamed=streamed,
    )  # fmt: skip
    _join(joining, join_errors, timeout + 30)
    if trainer.worker_init_info(port) != {k: v for k, v in init_info.items() if k != "layerwise_reload"}:
        raise RuntimeError(f"init info {init_info} differs from the trainer's {trainer.worker_init_info(port)}")
    manifest = trainer.manifest_of(tensors)
    update_info = {
        "names": [t.name for t in manifest.tensors],
        "dtype_names": [t.dtype for t in manifest.tensors],
        "shapes": [list(t.shape) for t in manifest.tensors],
    }
    client.start_weight_update()
    receiving, receive_errors = _in_thread(lambda: client.update_weights(update_info), "engine-receive")
    phases = trainer.send(tensors, manifest)
    _join(receiving, receive_errors, timeout + 30)
    client.finish_weight_update()
    trainer.shutdown()
    return {"tensors": len(tensors), "bytes": phases.bytes}


def run_ipc(config: dict[str, Any], tensors: list[tuple[str, Any]], client: RelayClient) -> dict[str, Any]:
    """Same-chip IPC: share packed buffers through shared memory; the engine copies each chunk."""
    from ascend_dist.common.device import get_runtime
    from ascend_dist.weight_transfer.ipc_trainer import IpcTrainer

    after = config.get("pause_after_buffers")
    control: Any = client if after is None else _PausingClient(client, int(after))
    runtime = get_runtime()
    ipc = IpcTrainer(control, runtime, packed=True, buffer_size_bytes=int(config["buffer_size_bytes"]))
    ipc.init()
    sent = ipc.send(tensors)
    return {"tensors": len(tensors), "messages": sent, "runtime": runtime.name}


def _corrupted(tensors: list[tuple[str, Any]], how: str | None) -> list[tuple[str, Any]]:
    """``tensors`` with the last one renamed (``"name"``) or grown by one row (``"shape"``)."""
    if how is None:
        return tensors
    import torch

    name, last = tensors[-1]
    if how == "name":
        return [*tensors[:-1], ("model.layers.0.no_such_projection.weight", last)]
    if how == "shape":
        return [*tensors[:-1], (name, torch.cat([last, last[:1]]))]
    raise ValueError(f"corrupt: {how!r} is not 'name' or 'shape'")


def main() -> int:
    """Run one update as configured by argv[1]; report on the protocol channel."""
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # library prints go to stderr; stdout carries only protocol lines
    config = msgspec.json.decode(sys.argv[1])
    client = RelayClient(protocol, sys.stdin.buffer, config.get("weight_version"))
    try:
        from safetensors.torch import load_file

        tensors = _corrupted(sorted(load_file(config["weights"]).items()), config.get("corrupt"))
        run = run_hccl if config["backend"] == "hccl" else run_ipc
        result = run(config, tensors, client)
    except BaseException as exc:
        client.emit({"event": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return 1
    client.emit({"event": "done", "vllm_imported": "vllm" in sys.modules, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
