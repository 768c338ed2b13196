# (vLLM is an optional extra: the default environment type-checks without it; run pyright with
# --pythonpath .nox/vllm/bin/python to check these modules against the pinned vLLM.)
"""vLLM adapter, trainer side: ``hccl`` and ``npu_ipc`` engines for ``WeightTransferTrainerFactory``.

Runs in: the trainer process, when the RL framework goes through vLLM's trainer API
(``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` then
``engine.send_weights()`` each round). Trainers that do not have vLLM installed use
`BroadcastTrainer` / `IpcTrainer` directly: these classes only wrap them.

Per ``vllm/distributed/weight_transfer/base.py`` (0.32 and 0.33): ``TrainerInitInfo`` has a
keyword-only ``rank`` (rank 0 sends) and a class-level ``backend``; ``trainer_init`` is a
classmethod called on every trainer rank; ``send_weights`` drives start, update(s) and finish
through the client. The two versions differ only in ``WeightSource``'s iteration API and the
engine's ``rank`` (see `_SOURCE_HAS_MODES`, `_ENGINE_TAKES_RANK`). The broadcast engine runs
the client's ``update_weights`` in a thread while it broadcasts, since both sides meet inside the
same collectives.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from ascend_dist.common.device import get_runtime
from ascend_dist.common.device.ipc import dtype_to_str
from ascend_dist.common.errors import ConfigError
from ascend_dist.weight_transfer.ipc import HandleExchange
from ascend_dist.weight_transfer.ipc_trainer import IpcTrainer, TorchDistExchange
from ascend_dist.weight_transfer.messages import (
    DEFAULT_BUFFER_SIZE_BYTES,
    DEFAULT_DIRECT_THRESHOLD_BYTES,
    DEFAULT_NUM_BUFFERS,
    Manifest,
    make_manifest,
)
from ascend_dist.weight_transfer.rpc_thread import beside_rpc, bounded_rpc
from ascend_dist.weight_transfer.trainer import BroadcastTrainer
from ascend_dist.weight_transfer.vllm_engine import _device_factory

__all__ = [
    "HCCLTrainerInitInfo",
    "HCCLTrainerWeightTransferEngine",
    "NPUIPCTrainerInitInfo",
    "NPUIPCTrainerWeightTransferEngine",
]

logger = logging.getLogger(__name__)


# vLLM 0.32's WeightSource has ``metadata()`` (a method), ``__iter__`` and ``held_names()``; 0.33 made
# ``metadata`` a cached property and added ``iter_full()``, ``owned_names(rank)`` and the
# ``implements_iter_full()`` check. `_metadata`, `_iter_full` and `_checked_source` tell them apart.
_SOURCE_HAS_MODES = hasattr(WeightSource, "implements_iter_full")
# vLLM 0.32's TrainerWeightTransferEngine.__init__ takes no ``rank`` (0.33 keeps it on the engine).
_ENGINE_TAKES_RANK = "rank" in inspect.signature(TrainerWeightTransferEngine.__init__).parameters


def _metadata(source: WeightSource) -> list[Any]:
    """The source's ``ParamMeta`` list."""
    return list(source.metadata if _SOURCE_HAS_MODES else source.metadata())  # type: ignore[operator]


def _iter_full(source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
    """One fresh pass over the source's full tensors."""
    return source.iter_full() if _SOURCE_HAS_MODES else iter(source)  # type: ignore[call-overload]


def _manifest(
    source: WeightSource,
    *,
    packed: bool,
    buffer_size_bytes: int,
    num_buffers: int,
    direct_threshold_bytes: int = 0,
    streamed: bool = False,
) -> Manifest:
    return make_manifest(
        [(m.name, dtype_to_str(m.dtype), tuple(m.shape)) for m in _metadata(source)],
        packed=packed, buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers,
        direct_threshold_bytes=direct_threshold_bytes, streamed=streamed,
    )  # fmt: skip


def _checked_source(source: WeightSource | None, rank: int) -> WeightSource:
    """The source, if every trainer rank yields every parameter in full (FSDP shards are gathered by it).

    A rank that owns only some parameters (a pipeline- or expert-split trainer) is refused: the
    broadcast sender and every IPC rank (each chip's worker reads its own rank's copy) send them all.
    """
    if source is None:
        raise ConfigError("source", None, "a vLLM WeightSource (full-resync backend)")
    if _SOURCE_HAS_MODES and not source.implements_iter_full():
        raise ConfigError("source", type(source).__name__, "a WeightSource implementing iter_full()")
    names = [m.name for m in _metadata(source)]
    held = source.owned_names(rank) if _SOURCE_HAS_MODES else source.held_names()  # type: ignore[attr-defined]
    if held is not None and set(held) != set(names):
        raise ConfigError(
            "source", f"rank {rank} owns {len(set(held))} of {len(names)} parameters",
            "every parameter on every trainer rank (FSDP shards are fine: iter_full gathers them)",
        )  # fmt: skip
    return source


def _trainer_exchange(rank: int) -> HandleExchange | None:
    """The colocated trainer ranks for IPC: torch.distributed's default group when it has several ranks.

    vLLM's own IPC trainer gathers on the default group too; it must be exactly the colocated trainer
    ranks, numbered as the init info's ``rank``. None: a single trainer rank.

    Raises:
        ConfigError: ``rank`` is not the default group's rank, or not 0 without a group.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if rank != 0:
            raise ConfigError("rank", rank, "0, or the rank in an initialised torch.distributed default group")
        return None
    if dist.get_rank() != rank:
        raise ConfigError("rank", rank, f"the default group's rank {dist.get_rank()} (handles are gathered on it)")
    return TorchDistExchange()


def _base_init(engine: TrainerWeightTransferEngine[Any], client: VLLMWeightSyncClient, source: WeightSource,
               is_sender: bool, rank: int) -> None:  # fmt: skip
    """Run the base engine's ``__init__``; ``engine.rank`` is set on every vLLM version."""
    if _ENGINE_TAKES_RANK:
        TrainerWeightTransferEngine.__init__(engine, client=client, source=source, is_sender=is_sender, rank=rank)
    else:
        TrainerWeightTransferEngine.__init__(engine, client=client, source=source, is_sender=is_sender)
        engine.rank = rank  # type: ignore[attr-defined]


@dataclass
class HCCLTrainerInitInfo(TrainerInitInfo):
    """Trainer init info of the ``hccl`` backend; the packing fields are sent to the workers at init."""

    backend: ClassVar[str] = "hccl"
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    packed_direct_threshold_bytes: int = DEFAULT_DIRECT_THRESHOLD_BYTES
    op_timeout_s: float = 300.0
    layerwise_reload: bool = True
    validate_names: bool = True
    streamed: bool = False


class HCCLTrainerWeightTransferEngine(TrainerWeightTransferEngine[HCCLTrainerInitInfo]):
    """Trainer side of the broadcast backend; rank 0 holds the communicator and drives the client."""

    init_info_cls = HCCLTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 rank: int = 0, init_info: HCCLTrainerInitInfo) -> None:  # fmt: skip
        """Store the wire parameters; `trainer_init` connects."""
        _base_init(self, client, source, is_sender, rank)
        self.init_info = init_info
        self.trainer: BroadcastTrainer | None = None

    @classmethod
    def trainer_init(
        cls, init_info: HCCLTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        """Rank 0: host the group while the workers join it (their init RPC runs in a thread)."""
        checked = _checked_source(source, init_info.rank)
        engine = cls(client=client, source=checked, is_sender=init_info.is_sender, rank=init_info.rank,
                     init_info=init_info)  # fmt: skip
        if not engine.is_sender:
            return engine
        payload: dict[str, Any] = {
            "master_address": init_info.master_address, "master_port": init_info.master_port, "rank_offset": 1,
            "world_size": init_info.world_size, "packed": init_info.packed,
            "packed_buffer_size_bytes": init_info.packed_buffer_size_bytes,
            "packed_num_buffers": init_info.packed_num_buffers, "op_timeout_s": init_info.op_timeout_s,
            "packed_direct_threshold_bytes": init_info.packed_direct_threshold_bytes,
            "layerwise_reload": init_info.layerwise_reload, "validate_names": init_info.validate_names,
            "streamed": init_info.streamed,
        }  # fmt: skip
        runtime = get_runtime()
        device = "cpu" if runtime.name == "cpu" else f"{runtime.name}:{runtime.device_index}"

        def connect() -> BroadcastTrainer:
            return BroadcastTrainer.connect(
                init_info.master_address, init_info.master_port, init_info.world_size, device=device,
                collective_factory=_device_factory(torch.device(device)),
                op_timeout_s=init_info.op_timeout_s, packed=init_info.packed,
                buffer_size_bytes=init_info.packed_buffer_size_bytes, num_buffers=init_info.packed_num_buffers,
                direct_threshold_bytes=init_info.packed_direct_threshold_bytes, streamed=init_info.streamed,
            )  # fmt: skip

        engine.trainer = beside_rpc(
            "init_weight_transfer_engine", lambda: client.init_weight_transfer_engine(payload), connect,
            timeout_s=init_info.op_timeout_s, local_timeout_s=max(init_info.op_timeout_s, 60.0) * 2 + 10.0,
            discard=lambda trainer: trainer.shutdown(),
        )  # fmt: skip
        return engine

    def send_weights(self) -> None:
        """One round: start, update (concurrently with the broadcast), finish."""
        assert self.source is not None
        if not self.is_sender:
            for _ in _iter_full(self.source):  # join the trainer-side gathers only
                pass
            return
        assert self.trainer is not None, "trainer_init() must run first"
        info = self.init_info
        manifest = _manifest(self.source, packed=info.packed, buffer_size_bytes=info.packed_buffer_size_bytes,
                             num_buffers=info.packed_num_buffers,
                             direct_threshold_bytes=info.packed_direct_threshold_bytes,
                             streamed=info.streamed)  # fmt: skip
        update = {"names": [t.name for t in manifest.tensors], "dtype_names": [t.dtype for t in manifest.tensors],
                  "shapes": [list(t.shape) for t in manifest.tensors]}  # fmt: skip
        self.client.start_weight_update()
        trainer, source = self.trainer, self.source
        beside_rpc(
            "update_weights", lambda: self.client.update_weights(update),
            lambda: trainer.send(_iter_full(source), manifest), timeout_s=info.op_timeout_s,
            local_timeout_s=info.op_timeout_s * 3 + 10.0,  # its collectives are bounded by op_timeout_s each
        )  # fmt: skip
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        """Destroy the communicator."""
        if self.trainer is not None:
            self.trainer.shutdown()
            self.trainer = None


@dataclass
class NPUIPCTrainerInitInfo(TrainerInitInfo):
    """Trainer init info of the ``npu_ipc`` backend."""

    backend: ClassVar[str] = "npu_ipc"
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    layerwise_reload: bool = True
    validate_names: bool = True
    op_timeout_s: float = 300.0


class _ClientAdapter:
    """Our `WeightSyncClient` over vLLM's client; adds the vLLM-only fields to the init payload.

    Every call must return within ``op_timeout_s`` (`DeadlineExceeded`; the engines' own errors pass
    unchanged): a client call cannot be interrupted, so a hung server would otherwise hang the trainer.
    """

    def __init__(
        self, client: VLLMWeightSyncClient, layerwise_reload: bool, validate_names: bool = True,
        op_timeout_s: float = 300.0,
    ) -> None:  # fmt: skip
        if not op_timeout_s > 0:
            raise ConfigError("op_timeout_s", op_timeout_s, "a positive number of seconds")
        self._client = client
        self._extra = {"layerwise_reload": layerwise_reload, "validate_names": validate_names}
        self._timeout_s = op_timeout_s

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        payload = {**init_info, **self._extra}
        bounded_rpc("init_weight_transfer_engine", lambda: self._client.init_weight_transfer_engine(payload),
                    timeout_s=self._timeout_s)  # fmt: skip

    def start_weight_update(self) -> None:
        bounded_rpc("start_weight_update", self._client.start_weight_update, timeout_s=self._timeout_s)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        bounded_rpc("update_weights", lambda: self._client.update_weights(update_info), timeout_s=self._timeout_s)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        bounded_rpc("finish_weight_update", lambda: self._client.finish_weight_update(weight_version),
                    timeout_s=self._timeout_s)  # fmt: skip


class NPUIPCTrainerWeightTransferEngine(TrainerWeightTransferEngine[NPUIPCTrainerInitInfo]):
    """Trainer side of the same-chip IPC backend; one rank per chip, gathered on the default group."""

    init_info_cls = NPUIPCTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 rank: int = 0, init_info: NPUIPCTrainerInitInfo) -> None:  # fmt: skip
        """Create the core `IpcTrainer` on the process's device runtime."""
        _base_init(self, client, source, is_sender, rank)
        self.init_info = init_info
        # Several trainer ranks (FSDP): every rank exports its gathered copy on its own chip, the handles
        # are merged on the default group, and only rank 0 calls the client.
        self.trainer = IpcTrainer(
            _ClientAdapter(client, init_info.layerwise_reload, init_info.validate_names, init_info.op_timeout_s),
            get_runtime(),
            packed=init_info.packed, buffer_size_bytes=init_info.packed_buffer_size_bytes,
            exchange=_trainer_exchange(rank),
        )  # fmt: skip

    @classmethod
    def trainer_init(
        cls, init_info: NPUIPCTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        """Build the engine; the sender ships the must-agree parameters to the workers."""
        checked = _checked_source(source, init_info.rank)
        engine = cls(client=client, source=checked, is_sender=init_info.is_sender, rank=init_info.rank,
                     init_info=init_info)  # fmt: skip
        if engine.is_sender:
            engine.trainer.init()
        return engine

    def send_weights(self) -> None:
        """One round: start, one message per chunk (or one for all tensors), finish."""
        assert self.source is not None
        info = self.init_info
        manifest = _manifest(self.source, packed=info.packed, buffer_size_bytes=info.packed_buffer_size_bytes,
                             num_buffers=1)  # fmt: skip
        self.trainer.send(_iter_full(self.source), manifest)
