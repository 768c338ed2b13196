"""Construction steps of `PyHcclCommunicator`: device choice, root-info exchange, arrival check, native init.

Runs in: worker and trainer processes (imports torch).

Every step that talks to ``group`` is bounded by a timeout, so a peer that never joins fails
construction with `DeadlineExceeded` instead of hanging in the native init.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from ascend_dist.common.device import DeviceRuntime
from ascend_dist.common.errors import ConfigError, DeadlineExceeded
from ascend_dist.hccl_ctypes import _collectives
from ascend_dist.hccl_ctypes._collectives import LibraryCollectives
from ascend_dist.hccl_ctypes._lib import CollectiveLibrary
from ascend_dist.hccl_ctypes.dialects import Dialect

__all__ = [
    "device_context",
    "device_index_of",
    "init_library",
    "library_configured",
    "normalise_device",
    "ready_check",
    "wait_work",
]


def wait_work(work: dist.Work | None, timeout_s: float, what: str) -> None:
    """Wait for a group operation, turning torch's timeout into `DeadlineExceeded`."""
    if work is None:
        return
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise DeadlineExceeded(f"{what} did not complete within {timeout_s:g} s (a peer did not join?): {exc}") from exc


def library_configured(dialect: Dialect, library_path: str | None) -> bool:
    """Whether a library was asked for explicitly (an argument or the dialect's env var)."""
    return bool(library_path or os.environ.get(dialect.env_var))


def device_index_of(device: int | str | torch.device | None) -> int | None:
    """The device index ``device`` names explicitly (``3``, ``"npu:3"``); None when it names none."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    if isinstance(device, str):  # parsed here: plain torch rejects "npu:3" until torch_npu is imported
        _, sep, text = device.partition(":")
        if sep and not text.isdigit():
            raise ConfigError("device", device, "an index or a device such as 'npu:0'")
        return int(text) if sep else None
    if isinstance(device, torch.device):
        return device.index
    raise ConfigError("device", device, "an index or a device such as 'npu:0'")


def normalise_device(runtime: DeviceRuntime, device: int | str | torch.device | None) -> torch.device:
    """The torch device for ``device`` on ``runtime``; None: the runtime's device.

    Raises:
        ConfigError: Not a device, or a device of another kind than the runtime's.
    """
    kind = "cpu" if runtime.name == "cpu" else runtime.name
    if device is None:
        return torch.device(kind) if kind == "cpu" else torch.device(kind, runtime.device_index)
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu") if kind == "cpu" else torch.device(kind, device)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("device", device, f"an index or a {kind} device") from None
    if dev.type != kind:
        raise ConfigError("device", device, f"a {kind} device (the {runtime.name} runtime)")
    return torch.device("cpu") if kind == "cpu" else dev  # CPU tensors carry no index; the runtime's is simulated


def ready_check(group: Any, world_size: int, timeout_s: float) -> None:
    """Bounded all-reduce on the group: every rank has arrived (else `DeadlineExceeded`).

    ``group`` is a ProcessGroup or a gloo Backend: only its own methods are called.
    """
    flag = torch.ones(1, dtype=torch.int32)
    work = group.allreduce([flag], _collectives.allreduce_options("SUM", timeout_s))
    wait_work(work, timeout_s, "communicator join")
    if int(flag.item()) != world_size:
        raise ConfigError("world_size", int(flag.item()), f"{world_size} ranks joining")


def device_context(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Make ``device`` current (HCCL's root info and both inits need it)."""
    if device.type == "cpu":
        return contextlib.nullcontext()
    module = getattr(torch, device.type)  # torch.cuda, or torch.npu once torch_npu is imported
    return module.device(device)


def init_library(
    lib: CollectiveLibrary, group: Any, rank: int, world_size: int, *, device: torch.device, timeout_s: float
) -> LibraryCollectives:
    """Join the native communicator: rank 0's root info is broadcast over ``group`` as raw bytes.

    Args:
        lib: The loaded collective library.
        group: The CPU group (a ProcessGroup or a gloo Backend).
        rank: This process's rank in ``group``.
        world_size: Size of ``group``.
        device: The communicator's device, made current around the native calls.
        timeout_s: Deadline of the id exchange and of the arrival check.

    Raises:
        DeadlineExceeded: A peer did not join within ``timeout_s``.
        CollectiveError: The library refused to create the communicator.
    """
    with device_context(device):
        uid = lib.get_unique_id() if rank == 0 else lib.dialect.id_type()
    raw = torch.frombuffer(bytearray(bytes(uid)), dtype=torch.uint8)
    work = group.broadcast([raw], _collectives.broadcast_options(0, timeout_s))
    wait_work(work, timeout_s, "root info broadcast")
    uid = lib.unique_id_from_bytes(raw.numpy().tobytes())
    ready_check(group, world_size, timeout_s)
    with device_context(device):
        comm = lib.comm_init_rank(world_size, uid, rank)
    return LibraryCollectives(lib, ctypes.c_void_p(comm.value))
