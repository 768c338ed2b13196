"""One FSDP trainer rank of the npu_ipc test: `python trainer_rank.py RANK PORT PACKED`.

Two such processes form a gloo default group (as an FSDP trainer does); each sets its own simulated
chip (rank r on cpu device r) and holds its parameters as DTensor shards (``Shard(0)``, 0-dim ones
replicated) from ``distribute_tensor``. Both drive vLLM's trainer API with vLLM's ``ModuleSource``
and our ``npu_ipc`` trainer engine. Rank 0 also hosts the two inference workers (vLLM's
``WeightTransferEngineFactory`` engines, one per chip, as threads) and the client that drives them;
rank 1's client only records calls (it must get none). Prints ``RESULT <json>``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from vllm.config import DeviceConfig, VllmConfig
from vllm.config.parallel import ParallelConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from ascend_dist.common.device import set_current_device
from ascend_dist.weight_transfer.registration import register_engines
from ascend_dist.weight_transfer.vllm_trainer import NPUIPCTrainerInitInfo

SPECS = [("w0", torch.float32, (5, 3)), ("w1", torch.bfloat16, (8,)), ("w2", torch.float32, ()),
         ("w3", torch.float16, (4, 6)), ("w4", torch.int8, (7, 2))]  # fmt: skip


def full_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, dtype, shape in SPECS:
        numel = 1
        for d in shape:
            numel *= d
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        out.append((name, raw.view(dtype).reshape(shape)))
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class Model(torch.nn.Module):
    """vLLM's ``load_weights`` surface over flat parameters (the inference side's model)."""

    def __init__(self) -> None:
        super().__init__()
        for name, dtype, shape in SPECS:
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))

    def load_weights(self, weights: Any) -> set[str]:
        params, loaded = dict(self.named_parameters()), set()
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
                loaded.add(name)
        return loaded


class EngineClient:
    """``VLLMWeightSyncClient`` calling both worker engines concurrently, as vLLM's collective RPC does."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines, self.pool, self.calls = engines, ThreadPoolExecutor(len(engines)), []

    def _each(self, name: str, fn: Any) -> None:
        self.calls.append(name)
        for future in [self.pool.submit(fn, e) for e in self.engines]:
            future.result(timeout=60)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each("init", lambda e: e.init_transfer_engine(e.parse_init_info(init_info)))

    def start_weight_update(self) -> None:
        self._each("start", lambda e: e.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._each("update", lambda e: e.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish", lambda e: e.finish_weight_update())


class RecordingClient:
    """A non-sender's client: records any call (there must be none)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append(name)


def worker_engines() -> tuple[list[Any], list[Model]]:
    models, engines = [Model(), Model()], []
    for chip, model in enumerate(models):
        set_current_device(chip)  # the worker engine's runtime (and IPC chip id) is the current device's
        pc = ParallelConfig()
        pc.data_parallel_index = chip
        config = VllmConfig(parallel_config=pc, device_config=DeviceConfig("cpu"))
        engines.append(WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="npu_ipc"), config, torch.device("cpu"), model))  # fmt: skip
    return engines, models


def main() -> None:
    rank, port, packed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "packed"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    register_engines()
    engines, models = worker_engines() if rank == 0 else ([], [])
    set_current_device(rank)  # this trainer rank's chip
    mesh = init_device_mesh("cpu", (2,))
    placement = {name: [Replicate()] if not shape else [Shard(0)] for name, _, shape in SPECS}
    trainer_model = torch.nn.Module()
    for name, t in full_weights(1):
        trainer_model.register_parameter(name, torch.nn.Parameter(distribute_tensor(t, mesh, placement[name]),
                                                                  requires_grad=False))  # fmt: skip
    client = EngineClient(engines) if rank == 0 else RecordingClient()
    info = NPUIPCTrainerInitInfo(rank=rank, packed=packed, packed_buffer_size_bytes=64, layerwise_reload=False)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(trainer_model))
    out: dict[str, Any] = {"rank": rank, "local_shapes": [list(p.to_local().shape) for p in trainer_model.parameters()]}
    rounds = []
    for seed in (2, 3):
        full = full_weights(seed)
        with torch.no_grad():
            for name, t in full:  # the optimizer step: each rank updates its own shard
                getattr(trainer_model, name).to_local().copy_(distribute_tensor(t, mesh, placement[name]).to_local())
        engine.send_weights()
        want = {name: digest(t) for name, t in full}
        rounds.append([{name: digest(p) for name, p in m.named_parameters()} == want for m in models])
    out.update(rounds=rounds, calls=client.calls)
    if rank == 0:
        out["uuids"] = [e.worker.uuid for e in engines]
        client.pool.shutdown()
    engine.shutdown()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
