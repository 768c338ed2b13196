"""The ``ipc`` commands of the demo's worker processes, served by a real `IpcWorker`.

Runs in: each worker process of `procs`, which forwards the driver's ``ipc`` commands here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ascend_dist.weight_transfer.ipc_worker import IpcWorker
from ascend_dist.weight_transfer.messages import IpcParams
from ascend_dist.weight_transfer.session import ModuleSink

if TYPE_CHECKING:
    import torch

__all__ = ["ipc_command_handler"]


def ipc_command_handler(model: torch.nn.Module) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Serve the demo driver's ``ipc`` commands against ``model`` (the toy worker processes of `procs`)."""
    from ascend_dist.common.device import CpuSimRuntime

    state: dict[str, Any] = {}

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        action = cmd.get("action") or cmd["op"]
        if action == "close":
            worker, runtime = state.pop("worker", None), state.pop("runtime", None)
            if worker is not None:
                worker.shutdown()
            if runtime is not None:
                runtime.close()
            return {}
        if action == "init":
            params = msgspec.convert(cmd["init_info"], IpcParams)
            worker = state.get("worker")
            if worker is None or cmd.get("uuid") is not None:  # a new identity needs a new engine
                runtime = state.get("runtime") or CpuSimRuntime()
                state["runtime"] = runtime
                sink = ModuleSink(model)
                worker = IpcWorker(sink, runtime, uuid=cmd.get("uuid"), validate=sink.validate)
                state["worker"] = worker
            worker.init(params)
            return {"uuid": worker.uuid}
        worker = state["worker"]
        if action == "start":
            worker.start()
        elif action == "update":
            worker.update(cmd["update_info"])
        elif action == "finish":
            worker.finish()
        return {}

    return handle
