"""A synthetic model and a worker process for the demo/bench scenario and the multi-process tests.

Runs in: the driving process (`WorkerProcess`, `ToyModel`, `synthetic_weights`) and spawned
worker processes (`worker_main`).

The driver talks to each worker over a pipe with JSON commands as raw bytes (never pickle):
``init`` (``collective``: ``"gloo"``, the default, or ``"hccl"`` for `hccl_collective`), ``start``,
``update``, ``finish``, ``digest``, ``ipc`` (IPC engine calls), ``raw`` (a bench baseline, see
`baselines`) and ``shutdown``.
A worker answers ``{"ok": true, ...}`` or ``{"ok": false, "error": <type>, "message": ...}``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ascend_dist.common.device.ipc import dtype_from_str, dtype_to_str
from ascend_dist.common.errors import ConfigError, DeadlineExceeded
from ascend_dist.weight_transfer.collective import Collective, Pending, TransferGroup, gloo_collective, hccl_collective
from ascend_dist.weight_transfer.messages import DEFAULT_DIRECT_THRESHOLD_BYTES

if TYPE_CHECKING:
    import torch

    from ascend_dist.common.device.cpu_sim import CpuSimRuntime


__all__ = [
    "Spec",
    "device_meter",
    "ToyModel",
    "WorkerProcess",
    "param_digests",
    "synthetic_specs",
    "synthetic_weights",
    "worker_main",
]

Spec = tuple[str, str, tuple[int, ...]]


def synthetic_specs(
    num_tensors: int, total_bytes: int, *, dtypes: Sequence[str] = ("float32", "bfloat16")
) -> list[Spec]:
    """``num_tensors`` specs of roughly ``total_bytes`` in all, with varied, unaligned sizes.

    Every fifth tensor is 0-dim; sizes vary by a deterministic pattern so tensors straddle buffers.
    """
    specs: list[Spec] = []
    per = max(total_bytes // max(num_tensors, 1), 1)
    for i in range(num_tensors):
        dtype = dtypes[i % len(dtypes)]
        itemsize = dtype_from_str(dtype).itemsize
        if i % 5 == 4:
            specs.append((f"layers.{i}.scale", dtype, ()))
            continue
        numel = max(1, (per * (50 + (i * 37) % 100)) // (100 * itemsize) + i % 7)
        cols = 1 + i % 13
        rows = max(1, numel // cols)
        specs.append((f"layers.{i}.weight", dtype, (rows, cols)))
    return specs


def llm_like_specs(num_tensors: int = 500, hidden: int = 512, vocab: int = 8192) -> list[Spec]:
    """A decoder-only LLM's parameter list: per layer 7 bf16 matrices and 5 small fp32 tensors.

    Like real checkpoints, most tensors are tiny (norms, biases, scales) and most bytes sit in a
    few large matrices. 500 tensors with ``hidden=512`` are about 265 MiB.
    """
    inter = hidden * 11 // 4
    head_dim = 64
    specs: list[Spec] = [("embed.weight", "bfloat16", (vocab, hidden))]
    layer = 0
    while len(specs) + 12 <= num_tensors - 2:
        p = f"layers.{layer}"
        specs += [
            (f"{p}.q_proj", "bfloat16", (hidden, hidden)), (f"{p}.k_proj", "bfloat16", (hidden, hidden)),
            (f"{p}.v_proj", "bfloat16", (hidden, hidden)), (f"{p}.o_proj", "bfloat16", (hidden, hidden)),
            (f"{p}.gate_proj", "bfloat16", (inter, hidden)), (f"{p}.up_proj", "bfloat16", (inter, hidden)),
            (f"{p}.down_proj", "bfloat16", (hidden, inter)), (f"{p}.input_norm", "float32", (hidden,)),
            (f"{p}.post_norm", "float32", (hidden,)), (f"{p}.q_norm", "float32", (head_dim,)),
            (f"{p}.k_norm", "float32", (head_dim,)), (f"{p}.o_bias", "bfloat16", (hidden,)),
        ]  # fmt: skip
        layer += 1
    while len(specs) < num_tensors - 2:
        specs.append((f"layers.{layer}.scale{len(specs)}", "float32", ()))
    specs += [("final.norm", "float32", (hidden,)), ("lm_head.weight", "bfloat16", (vocab, hidden))]
    return specs


class _Holder:
    """Namespace for lazily-built torch classes (torch is imported only when a model is built)."""


def _toy_model_cls() -> type:
    import torch

    class ToyModelImpl(torch.nn.Module):
        """A module tree whose ``named_parameters()`` are exactly the specs' dotted names (zeros, no grad)."""

        def __init__(self, specs: Sequence[Spec]) -> None:
            super().__init__()
            for name, dtype, shape in specs:
                *path, leaf = name.split(".")
                module: torch.nn.Module = self
                for part in path:
                    child = module._modules.get(part)
                    if child is None:
                        child = torch.nn.Module()
                        module.add_module(part, child)
                    module = child
                tensor = torch.zeros(shape, dtype=dtype_from_str(dtype))
                module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))

    return ToyModelImpl


def ToyModel(specs: Sequence[Spec]) -> torch.nn.Module:  # noqa: N802 - a factory standing in for a class
    """A ``torch.nn.Module`` holding zero parameters of the given specs."""
    cls = getattr(_Holder, "cls", None)
    if cls is None:
        cls = _toy_model_cls()
        _Holder.cls = cls  # type: ignore[attr-defined]
    return cls(specs)


def synthetic_weights(specs: Sequence[Spec], seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random bit patterns (any value, NaNs included) for every spec, reproducible from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    out: list[tuple[str, torch.Tensor]] = []
    for name, dtype, shape in specs:
        dt = dtype_from_str(dtype)
        numel = 1
        for d in shape:
            numel *= d
        raw = torch.randint(0, 256, (numel * dt.itemsize,), dtype=torch.uint8, generator=gen)
        out.append((name, raw.view(dt).reshape(shape)))
    return out


def param_digests(pairs: Iterator[tuple[str, torch.Tensor]] | Sequence[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """SHA-256 of every tensor's bytes (bit-exact comparison across processes)."""
    import torch

    out: dict[str, str] = {}
    for name, t in pairs:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.sha256(data + dtype_to_str(t.dtype).encode() + repr(tuple(t.shape)).encode()).hexdigest()
    return out


class _DieAfter:
    """A `Collective` that kills its process once ``after`` data broadcasts have completed (tests)."""

    def __init__(self, inner: Collective, after: int) -> None:
        self._inner = inner
        self._left = after + 2  # the header and the manifest come first
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> Pending:
        pending = self._inner.broadcast(tensor, src)
        self._left -= 1
        if self._left < 0:
            pending.wait()
            os._exit(17)  # simulated crash mid-update: no cleanup, like a killed process
        return pending

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._inner.all_reduce_sum(tensor)

    def barrier(self) -> None:
        self._inner.barrier()

    def destroy(self) -> None:
        self._inner.destroy()


def device_meter() -> CpuSimRuntime:
    """This process's simulated device, whose allocation counters measure staging memory.

    Raises:
        ConfigError: The process runs on a hardware backend (measure with the device's own
            allocator statistics there).
    """
    from ascend_dist.common.device import get_runtime
    from ascend_dist.common.device.cpu_sim import CpuSimRuntime

    runtime = get_runtime()
    if not isinstance(runtime, CpuSimRuntime):
        raise ConfigError("device backend", runtime.name, "cpu (the simulation counts its allocations)")
    return runtime


def _inspect(state: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    """``digest``: the model's tensor digests; ``memory``: the simulated device's allocation counters."""
    if cmd["op"] == "digest":
        return {"digests": param_digests(list(state["model"].named_parameters()))}
    meter = device_meter()
    if cmd.get("reset_peak"):
        meter.reset_peak_allocated()
    return {"allocated": meter.allocated_bytes, "peak": meter.peak_allocated_bytes}


def _dispatch(state: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    from ascend_dist.weight_transfer.session import ModuleSink
    from ascend_dist.weight_transfer.worker import BroadcastWorker, worker_group_rank

    op = cmd["op"]
    if op == "init":
        die_after = cmd.get("die_after_buffers")

        base = hccl_collective if cmd.get("collective", "gloo") == "hccl" else gloo_collective

        def factory(group: TransferGroup, device: torch.device) -> Collective:
            comm = base(group, device)
            return comm if die_after is None else _DieAfter(comm, int(die_after))

        old = state.pop("engine", None)
        if old is not None:  # re-init: leave the previous group first
            old.shutdown()
        sink = ModuleSink(state["model"])
        engine = BroadcastWorker(sink, collective_factory=factory, validate=sink.validate)
        rank = worker_group_rank(cmd["rank_offset"], cmd["dp_index"], cmd["replica_size"], cmd["rank_in_replica"])
        engine.init(
            master_address=cmd["master_address"], master_port=cmd["master_port"], rank=rank,
            world_size=cmd["world_size"], packed=cmd["packed"], buffer_size_bytes=cmd["buffer_size_bytes"],
            num_buffers=cmd["num_buffers"], op_timeout_s=cmd["op_timeout_s"],
            direct_threshold_bytes=cmd.get("direct_threshold_bytes", DEFAULT_DIRECT_THRESHOLD_BYTES),
            streamed=cmd.get("streamed", False),
        )  # fmt: skip
        state["engine"], state["sink"] = engine, sink
        return {"rank": rank, "collective": type(engine.collective).__name__}
    if op in ("digest", "memory"):
        return _inspect(state, cmd)
    if op == "ipc":
        return state["ipc"](cmd)
    if op == "raw":
        from ascend_dist.weight_transfer._demo.baselines import raw_receive

        return raw_receive(state["engine"].collective, state["model"], cmd)
    engine = state["engine"]
    if op == "restore_point":  # the bench's packed update with and without the host restore point
        state["sink"].restore = bool(cmd["on"])
    elif op == "start":
        engine.start()
    elif op == "update":
        phases = engine.update(cmd["names"], cmd["dtype_names"], cmd["shapes"])
        return {"unpack_s": phases.pack_s, "transfer_s": phases.transfer_s, "load_s": phases.load_s,
                "extra": phases.extra}  # fmt: skip
    elif op == "finish":
        engine.finish()
    elif op == "leave":  # before the trainer closes the group's store, so no heartbeat writes into a dead one
        state.pop("engine").shutdown()
    return {}


def worker_main(conn: multiprocessing.connection.Connection, specs_json: str) -> None:
    """Entry point of a worker process: build the model, then serve commands until ``shutdown``."""
    import torch

    from ascend_dist.weight_transfer._demo.ipc_commands import ipc_command_handler

    torch.set_num_threads(1)  # this process stands in for one device worker; one CPU thread is its "device"
    specs = [(n, d, tuple(s)) for n, d, s in json.loads(specs_json)]
    model = ToyModel(specs)
    state: dict[str, Any] = {"model": model}
    state["ipc"] = ipc_command_handler(model)
    try:
        while True:
            cmd = json.loads(conn.recv_bytes())
            if cmd["op"] == "shutdown":
                break
            try:
                reply = {"ok": True, **_dispatch(state, cmd)}
            except Exception as exc:  # reported to the driver, which raises it there
                reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
            conn.send_bytes(json.dumps(reply).encode())
    finally:
        engine = state.get("engine")
        if engine is not None:
            engine.shutdown()
        state["ipc"]({"op": "close"})
        conn.send_bytes(json.dumps({"ok": True}).encode())
        conn.close()


_PRELOAD = [
    "torch",
    "torch.distributed",
    "ascend_dist.weight_transfer.worker",
    "ascend_dist.weight_transfer.ipc_worker",
]


def _context() -> multiprocessing.context.ForkServerContext:
    """A forkserver context that imports torch once: workers then start in milliseconds, not seconds.

    The fork server is a clean process (no threads, no device), so forking it is safe.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class WorkerProcess:
    """A worker process (from the fork server) and its command pipe; `close` always reaps it."""

    def __init__(self, specs: Sequence[Spec]) -> None:
        """Start the process with a model of ``specs``."""
        ctx = _context()
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, json.dumps(specs)), daemon=True)
        self.process.start()
        child.close()

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds the process used so far (Linux ``/proc``), None where unreadable."""
        try:
            with open(f"/proc/{self.process.pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        except (OSError, ValueError, IndexError):
            return None

    def send(self, op: str, **fields: Any) -> None:
        """Send a command without waiting for its reply."""
        self._conn.send_bytes(json.dumps({"op": op, **fields}).encode())

    def reply(self, timeout_s: float) -> dict[str, Any]:
        """The next reply (raises `DeadlineExceeded` after ``timeout_s`` or if the process died)."""
        if not self._conn.poll(timeout_s):
            raise DeadlineExceeded(f"worker pid {self.process.pid} did not reply within {timeout_s} s")
        try:
            return json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            raise DeadlineExceeded(f"worker pid {self.process.pid} exited (code {self.process.exitcode})") from None

    def call(self, op: str, timeout_s: float = 60.0, **fields: Any) -> dict[str, Any]:
        """Send a command and wait for its reply."""
        self.send(op, **fields)
        return self.reply(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to shut down, then terminate/kill it if needed; always joins."""
        if self.process.is_alive():
            try:
                self.send("shutdown")
                self._conn.poll(timeout_s)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()
