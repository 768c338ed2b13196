# (vLLM is an optional extra: the default environment type-checks without it; run pyright with
# --pythonpath .nox/vllm/bin/python to check these modules against the pinned vLLM.)
"""vLLM adapter, worker side: the ``hccl`` and ``npu_ipc`` weight-transfer engines.

Runs in: vLLM worker processes (created by ``WeightTransferEngineFactory.create_engine(config,
vllm_config, device, model)`` right after the model is loaded). vLLM calls, per the pinned
``vllm/distributed/weight_transfer/base.py`` (0.33): ``init_transfer_engine`` once, then per update
``start_weight_update``, ``update_weights`` (parse, ``receive_weights``, sync) one or more times,
``finish_weight_update``; ``shutdown`` at the end.

The classes are thin: they translate vLLM's dataclasses and configs into `BroadcastWorker` /
`IpcWorker` calls. Two deliberate differences from vLLM's own NCCL/IPC engines:

- weights are staged and applied to the model only once a whole update arrived; vLLM's layerwise
  reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``) then runs around that
  one apply, not from ``start`` to ``finish``, so an aborted update never leaves layers on the meta
  device (disable it with ``layerwise_reload=False`` for models not loaded by vLLM); a loader that
  raises during that apply is undone on every rank from a host copy taken just before it
  (``restore_on_load_failure``, see `restore` and `broadcast`'s load vote);
- ``update_weights`` synchronises through ``ascend_dist.common.device`` rather than
  ``torch.accelerator.synchronize()``, which raises on a CPU-only host;
- an update that leaves mixed weights (a streamed update broken midway, a loader failure that
  could not be undone on every rank) trips the worker's `guard.WeightsGuard`, installed on the
  model here: every forward then raises `WeightsInconsistent` naming the cause until a complete
  update succeeds. In vLLM an exception in the forward fails the engine core's step, so the engine
  stops serving (vLLM reports it dead) rather than generate from mixed weights; it does not
  answer later requests with the typed error one by one (vLLM has no per-request refusal that a
  worker-side engine can reach).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ascend_dist.common.device import get_runtime
from ascend_dist.common.errors import ConfigError, ProtocolError
from ascend_dist.weight_transfer.collective import gloo_collective, hccl_collective
from ascend_dist.weight_transfer.errors import LoadFailed, ManifestMismatch
from ascend_dist.weight_transfer.ipc_worker import IpcWorker
from ascend_dist.weight_transfer.load_vote import ReplicaExchange, StoreLoadVote, replica_store
from ascend_dist.weight_transfer.messages import (
    DEFAULT_BUFFER_SIZE_BYTES,
    DEFAULT_DIRECT_THRESHOLD_BYTES,
    DEFAULT_NUM_BUFFERS,
    PROTOCOL_VERSION,
    IpcParams,
    Manifest,
)
from ascend_dist.weight_transfer.model_names import mismatches, unknown_names
from ascend_dist.weight_transfer.pool import BufferPool
from ascend_dist.weight_transfer.restore import ModuleSnapshot
from ascend_dist.weight_transfer.vllm_replica import VllmReplicaExchange
from ascend_dist.weight_transfer.worker import BroadcastWorker, worker_group_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = [
    "HCCLWeightTransferEngine",
    "HCCLWeightTransferInitInfo",
    "HCCLWeightTransferUpdateInfo",
    "NPUIPCWeightTransferEngine",
    "NPUIPCWeightTransferInitInfo",
    "NPUIPCWeightTransferUpdateInfo",
]

logger = logging.getLogger(__name__)


class _ReloadSnapshot:
    """A `ModuleSnapshot` of the model that also clears what a failed layer-wise reload left behind."""

    def __init__(self, model: torch.nn.Module, layerwise: bool, pool: BufferPool) -> None:
        self._model, self._layerwise = model, layerwise
        self._snapshot = ModuleSnapshot(model, pool)

    def restore(self) -> None:
        """Swap meta placeholders back for the original tensors, copy the old values in, reset vLLM's reload state."""
        self._snapshot.restore()
        if not self._layerwise:
            return
        from vllm.model_executor.model_loader.reload import layerwise

        # without this, the next initialize_layerwise_reload would skip every layer it still thinks is loading
        infos = getattr(layerwise, "LAYERWISE_INFO", {})  # 0.32 and 0.33 both have it; read, never assumed
        for module in self._model.modules():
            info = infos.get(module)
            if info is not None:
                info.reset()
        loading = getattr(layerwise, "LOADING_LAYERS", None)
        if loading is not None:
            loading.clear()
        if hasattr(self._model, "_original_do_torchao_reload"):
            self._model._do_torchao_reload = self._model._original_do_torchao_reload  # pyright: ignore[reportAttributeAccessIssue]


class _ModelSink:
    """Loads into the engine's *current* target model (vLLM retargets it for draft-model updates)."""

    def __init__(self, engine: WeightTransferEngine[Any, Any], layerwise: bool) -> None:  # vLLM generic boundary
        self._engine = engine
        self.layerwise = layerwise
        self.restore = True
        self._restore_pool = BufferPool()  # the host copy's bytes, kept between updates (see `restore`)

    def snapshot(self) -> _ReloadSnapshot | None:
        """A host copy of the model before a staged update loads (None with ``restore_on_load_failure`` off)."""
        return _ReloadSnapshot(self._engine.model, self.layerwise, self._restore_pool) if self.restore else None

    def release(self) -> None:
        """Free the host copy's bytes (engine shutdown)."""
        self._restore_pool.clear()

    def validate(self, manifest: Manifest) -> None:
        """Refuse (before the commit vote) names the current model cannot load, and shapes / dtypes it cannot take.

        Raises:
            ManifestMismatch: Names the model has no parameter for, or tensors whose shape or dtype
                its loaders would refuse or silently cast (the first few are quoted).
        """
        model = self._engine.model
        unknown = unknown_names(model, (t.name for t in manifest.tensors))
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ManifestMismatch(
                f"{len(unknown)} tensor name(s) match no parameter of the model: {shown}{more} "
                "(a model whose loader renames otherwise: init with validate_names=False)"
            )
        wrong = mismatches(model, ((t.name, t.dtype, tuple(t.shape)) for t in manifest.tensors))
        if wrong:
            more = f"; and {len(wrong) - 5} more" if len(wrong) > 5 else ""
            raise ManifestMismatch(
                f"{len(wrong)} tensor(s) the model cannot take as sent: {'; '.join(wrong[:5])}{more} "
                "(to skip these checks: init with validate_names=False)"
            )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        """Load through the model's own loader; its failure is a typed `LoadFailed` naming the cause."""
        try:
            return self._load(weights)
        except Exception as exc:
            raise LoadFailed(
                f"the model's loader failed after the update was committed: {type(exc).__name__}: {exc}"
            ) from exc

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        model = self._engine.model
        if not self.layerwise:
            with disable_mtp_completeness_check():
                return model.load_weights(weights)  # pyright: ignore[reportCallIssue]
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(model)
        with disable_mtp_completeness_check():
            loaded = model.load_weights(weights)  # pyright: ignore[reportCallIssue]
        finalize_layerwise_reload(model, self._engine.model_config)
        return loaded


@dataclass
class HCCLWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker init info of the ``hccl`` backend (field names are the JSON wire format).

    ``rank_offset`` is the number of trainer ranks (1); ``world_size`` counts the trainer and every
    worker across DP replicas. The packing fields must equal the trainer's (they are checked again
    in-band on every update).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_NUM_BUFFERS
    packed_direct_threshold_bytes: int = DEFAULT_DIRECT_THRESHOLD_BYTES
    op_timeout_s: float = 300.0
    layerwise_reload: bool = True
    validate_names: bool = True
    streamed: bool = False
    restore_on_load_failure: bool = True


@dataclass
class HCCLWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-update metadata: tensor names, dtype names and shapes in the trainer's send order.

    The old per-round packing fields are still accepted; when given they must equal the init values.
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    packed: bool | None = None
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None

    def __post_init__(self) -> None:
        """Check the three lists have one entry per tensor (vLLM's wording)."""
        for name in ("dtype_names", "shapes"):
            if len(getattr(self, name)) != len(self.names):
                raise ValueError(
                    f"`{name}` should be of the same size as `names`: "
                    f"got {len(getattr(self, name))} and {len(self.names)}"
                )


def _device_factory(device: torch.device):
    return gloo_collective if device.type == "cpu" else hccl_collective


class HCCLWeightTransferEngine(WeightTransferEngine[HCCLWeightTransferInitInfo, HCCLWeightTransferUpdateInfo]):
    """Broadcast weight transfer (backend ``hccl``): HCCL on Ascend, NCCL on CUDA, gloo on the CPU."""

    init_info_cls = HCCLWeightTransferInitInfo
    update_info_cls = HCCLWeightTransferUpdateInfo

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        """Create the engine (positional arguments, as the factory calls it)."""
        super().__init__(config, vllm_config, device, model)
        self._sink = _ModelSink(self, layerwise=True)
        self._validate_names = True
        self.worker = BroadcastWorker(
            self._sink, device=device, collective_factory=_device_factory(device), validate=self._validate
        )
        self.worker.guard.install(model)  # refuse to run on mixed weights (see the module docstring)

    def _validate(self, manifest: Manifest) -> None:
        """Before the commit vote: every name must be one the model can load."""
        if self._validate_names:
            self._sink.validate(manifest)

    def init_transfer_engine(self, init_info: HCCLWeightTransferInitInfo) -> None:
        """Join the trainer's group as ``rank_offset + dp_index * replica_size + rank``."""
        pc = self.parallel_config
        rank = worker_group_rank(init_info.rank_offset, pc.data_parallel_index, pc.world_size, pc.rank)
        if init_info.streamed and init_info.layerwise_reload:
            # the sink runs vLLM's layer-wise reload around each load_weights call, i.e. once per bucket
            raise ConfigError(
                "layerwise_reload", True, "false with streamed=true (layer-wise reload across buckets: not yet)"
            )
        self._sink.layerwise = init_info.layerwise_reload
        self._sink.restore = init_info.restore_on_load_failure
        self._validate_names = init_info.validate_names
        self.worker.init(
            master_address=init_info.master_address, master_port=init_info.master_port, rank=rank,
            world_size=init_info.world_size, packed=init_info.packed,
            buffer_size_bytes=init_info.packed_buffer_size_bytes, num_buffers=init_info.packed_num_buffers,
            op_timeout_s=init_info.op_timeout_s, direct_threshold_bytes=init_info.packed_direct_threshold_bytes,
            streamed=init_info.streamed,
        )  # fmt: skip

    def start_weight_update(self) -> None:
        """Open an update (`UpdateStateError` if one is open)."""
        self.worker.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:  # vLLM passes a JSON dict
        """Parse, receive and apply one update, then synchronise the device."""
        self.receive_weights(self.parse_update_info(update_info))
        get_runtime(self.device).synchronize()

    def receive_weights(self, update_info: HCCLWeightTransferUpdateInfo) -> None:
        """Receive one update and load it into the model once every rank has all of it."""
        refuse = ""
        for name, mine in (("packed", self.worker.packed), ("packed_buffer_size_bytes", self.worker.buffer_size_bytes),
                           ("packed_num_buffers", self.worker.num_buffers)):  # fmt: skip
            theirs = getattr(update_info, name)
            if theirs is not None and theirs != mine:
                refuse = f"update_info.{name}={theirs!r} differs from the init value {mine!r}"
        # a refusal still joins the exchange and votes no: the trainer fails at once, naming it
        self.worker.update(update_info.names, update_info.dtype_names, update_info.shapes, refuse=refuse)

    def finish_weight_update(self) -> None:
        """Close the update (`UpdateStateError` if none is open)."""
        self.worker.finish()

    def shutdown(self) -> None:
        """Destroy the communicator and leave the group; free the host restore point."""
        try:
            self.worker.shutdown()
        finally:
            self._sink.release()


@dataclass
class NPUIPCWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker init info of the ``npu_ipc`` backend, sent by the trainer."""

    packed: bool = True
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES
    version: int = PROTOCOL_VERSION
    layerwise_reload: bool = True
    validate_names: bool = True
    streamed: bool = False
    restore_on_load_failure: bool = True
    vote_timeout_s: float = 300.0


@dataclass
class NPUIPCWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One IPC update message: ``chunk`` is an `IpcChunk` as JSON builtins (no pickle)."""

    chunk: dict[str, Any] = field(default_factory=dict)  # JSON object from the control plane


class NPUIPCWeightTransferEngine(WeightTransferEngine[NPUIPCWeightTransferInitInfo, NPUIPCWeightTransferUpdateInfo]):
    """Same-chip IPC weight transfer (backend ``npu_ipc``); shared memory on the CPU."""

    init_info_cls = NPUIPCWeightTransferInitInfo
    update_info_cls = NPUIPCWeightTransferUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
        *,
        replica: ReplicaExchange | None = None,
    ) -> None:
        """Create the engine on the runtime of vLLM's ``device`` (its chip id names that device).

        ``replica``: how the replica's ranks agree on the load vote's store at init; default (vLLM's
        factory passes none) vLLM's own groups of this worker, `VllmReplicaExchange`.
        """
        super().__init__(config, vllm_config, device, model)
        self._sink = _ModelSink(self, layerwise=True)
        self._validate_names = True
        self._refused_finish: str | None = None  # why the last finish failed while vLLM's session stays open
        self._replica = replica
        # every worker of this replica (TP x PP x PCP) loads each update through its own RPC; they
        # agree on keeping it through the load vote built at init
        self.worker = IpcWorker(
            self._sink, get_runtime(device), validate=self._validate, peers=self.parallel_config.world_size
        )
        self.worker.guard.install(model)  # refuse to run on mixed weights (see the module docstring)

    def _validate(self, manifest: Manifest) -> None:
        """Before anything is loaded: every name must be one the model can load."""
        if self._validate_names:
            self._sink.validate(manifest)

    def init_transfer_engine(self, init_info: NPUIPCWeightTransferInitInfo) -> None:
        """Record the trainer's must-agree parameters."""
        if init_info.streamed and init_info.layerwise_reload:
            # the sink runs vLLM's layer-wise reload around each load_weights call, i.e. once per chunk
            raise ConfigError(
                "layerwise_reload", True, "false with streamed=true (layer-wise reload across chunks: not yet)"
            )
        self._sink.layerwise = init_info.layerwise_reload
        self._sink.restore = init_info.restore_on_load_failure
        self._validate_names = init_info.validate_names
        self._join_load_vote(init_info.vote_timeout_s)
        self.worker.init(
            msgspec.convert(
                {
                    "version": init_info.version,
                    "packed": init_info.packed,
                    "buffer_size_bytes": init_info.buffer_size_bytes,
                    "streamed": init_info.streamed,
                },
                IpcParams,
            )
        )

    def _join_load_vote(self, timeout_s: float) -> None:
        """With several ranks in the replica, join (rank 0: host) the store of their load vote."""
        if timeout_s <= 0:
            raise ConfigError("vote_timeout_s", timeout_s, "a positive number of seconds")
        if self.worker.vote is not None:
            self.worker.vote.close()
            self.worker.vote = None
        if self.worker.peers == 1:
            return
        replica = self._replica if self._replica is not None else VllmReplicaExchange()
        store = replica_store(replica)
        if store is not None:
            self.worker.vote = StoreLoadVote(store, replica.rank, replica.world_size, timeout_s=timeout_s)

    def start_weight_update(self) -> None:
        """Open an update."""
        self._refused_finish = None  # vLLM only calls start once its own session is closed
        self.worker.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:  # vLLM passes a JSON dict
        """Apply one IPC message, then synchronise the device."""
        self.receive_weights(self.parse_update_info(update_info))
        get_runtime(self.device).synchronize()

    def receive_weights(self, update_info: NPUIPCWeightTransferUpdateInfo) -> None:
        """Open this chip's handles and load (packed: stage, load after the last chunk)."""
        self.worker.update({"chunk": update_info.chunk})

    def finish_weight_update(self) -> None:
        """Close the update (a packed update missing chunks is refused, nothing loaded).

        vLLM's worker closes its own session only when this returns (0.32 and 0.33 alike), so after
        a refusal it still holds one open and refuses every ``start_weight_update``; the refusal
        says so, and the next ``finish_weight_update`` closes vLLM's session without error.
        """
        if self._refused_finish is not None:
            logger.info("closing vLLM's weight-update session left open by: %s", self._refused_finish)
            self._refused_finish = None
            return
        try:
            self.worker.finish()
        except ProtocolError as exc:
            self._refused_finish = str(exc)
            raise ProtocolError(
                f"{exc}; the model keeps its previous weights. vLLM keeps its update session open after "
                "a failed finish: call finish_weight_update once more to close it"
            ) from exc

    def shutdown(self) -> None:
        """Forget opened mappings; leave the load vote (rank 0: stop its store); free the host restore point."""
        if self.worker.vote is not None:
            self.worker.vote.close()
            self.worker.vote = None
        try:
            self.worker.shutdown()
        finally:
            self._sink.release()
