"""Benchmark baselines on the broadcast engine's own collective (the ``weights`` bench).

Runs in: the bench's trainer process (`raw_send`) and its worker processes (`raw_receive`).

Every baseline starts from the same source tensors and, except the wire ceiling, ends with the same
bytes in the worker's model, like the packed update it is compared with:

- ``per_tensor``: upstream's unpacked path: one broadcast per tensor; the worker allocates each
  tensor, receives it and copies it into the model.
- ``flat``: one flat buffer of the same bytes: the trainer copies every tensor into a preallocated
  buffer, broadcasts it once; the worker receives into a preallocated buffer and copies each tensor
  out into the model (the same copies as the packed path, without its pipelining and its checks).
- ``flat_wire``: the wire ceiling: a preallocated, already filled buffer broadcast once into a
  preallocated buffer; nothing is packed or loaded.

Buffers are kept between runs (like the engine's `BufferPool`), so no baseline pays page faults.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ascend_dist.common.errors import ConfigError
from ascend_dist.weight_transfer.collective import Collective
from ascend_dist.weight_transfer.packing import as_bytes, copy_bytes
from ascend_dist.weight_transfer.pool import BufferPool

if TYPE_CHECKING:
    import torch

__all__ = ["MODES", "CommandPeer", "raw_receive", "raw_send"]

MODES = ("per_tensor", "flat", "flat_wire")
_POOL = BufferPool()  # one per process: the baselines' preallocated buffers


class CommandPeer(Protocol):
    """A worker process the driver sends JSON commands to (`procs.WorkerProcess`)."""

    def send(self, op: str, **fields: Any) -> None:
        """Send a command without waiting for its reply."""
        ...

    def reply(self, timeout_s: float) -> dict[str, Any]:
        """The next reply."""
        ...


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError("mode", mode, ", ".join(MODES))


def raw_receive(comm: Collective, model: torch.nn.Module, cmd: dict[str, Any]) -> dict[str, Any]:
    """Worker side of one baseline run (``cmd``: ``mode``, ``nbytes``, ``names``); returns its seconds."""
    import torch

    mode = cmd["mode"]
    _check_mode(mode)
    params = dict(model.named_parameters())
    t0 = time.perf_counter()
    if mode == "per_tensor":
        for name in cmd["names"]:
            target = params[name]
            weight = torch.empty_like(target)
            if weight.numel():
                image = weight.reshape(-1).view(torch.uint8)
                comm.broadcast(image, 0).wait()
                copy_bytes(target.detach().reshape(-1).view(torch.uint8), image)  # the same copy as ModuleSink
    else:
        buf = _POOL.get("flat", int(cmd["nbytes"]), comm.device)
        comm.broadcast(buf, 0).wait()
        if mode == "flat":
            offset = 0
            for name in cmd["names"]:
                target = params[name].detach()
                size = target.numel() * target.element_size()
                if size:
                    copy_bytes(target.reshape(-1).view(torch.uint8), buf[offset : offset + size])
                offset += size
    return {"seconds": time.perf_counter() - t0}


def raw_send(
    comm: Collective,
    workers: Sequence[CommandPeer],
    mode: str,
    weights: Sequence[tuple[str, torch.Tensor]],
    timeout_s: float,
    *,
    refill: bool = True,
) -> float:
    """Trainer side of one baseline run; returns seconds until every worker finished.

    ``refill=False`` (``flat_wire`` only): the buffer already holds these weights from an earlier
    run, so the untimed fill is skipped too (the bench then meters this call's CPU as the wire's).

    Raises:
        ConfigError: Unknown ``mode``.
        RuntimeError: A worker reported a failure.
    """
    _check_mode(mode)
    images = [as_bytes(t) for _, t in weights]
    nbytes = sum(i.numel() for i in images)
    buf = _POOL.get("flat", nbytes, comm.device) if mode != "per_tensor" else None
    if buf is not None and mode == "flat_wire" and refill:
        _fill(buf, images)  # untimed: the wire ceiling starts from a filled buffer
    t0 = time.perf_counter()
    for w in workers:
        w.send("raw", mode=mode, nbytes=nbytes, names=[n for n, _ in weights])
    if buf is None:
        for image in images:
            if image.numel():
                comm.broadcast(image, 0).wait()
    else:
        if mode == "flat":
            _fill(buf, images)
        comm.broadcast(buf, 0).wait()
    for w in workers:
        reply = w.reply(timeout_s)
        if not reply["ok"]:
            raise RuntimeError(f"worker failed: {reply['error']}: {reply['message']}")
    return time.perf_counter() - t0


def _fill(buf: torch.Tensor, images: Sequence[torch.Tensor]) -> None:
    offset = 0
    for image in images:
        copy_bytes(buf[offset : offset + image.numel()], image)
        offset += image.numel()
