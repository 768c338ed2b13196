"""vllm-ascend's static trainer API (``trainer_init`` / ``trainer_send_weights``) over our broadcast protocol.

Runs in: the trainer process (torch only, never vLLM). An RL framework written against vllm-ascend's
``HCCLWeightTransferEngine`` static methods switches by changing one import:

    from ascend_dist.weight_transfer.static_trainer import HCCLWeightTransferEngine

    group = HCCLWeightTransferEngine.trainer_init(
        dict(master_address=addr, master_port=port, world_size=1 + num_workers))
    # each round, while the workers run update_weights(names, dtype_names, shapes):
    HCCLWeightTransferEngine.trainer_send_weights(model.named_parameters(), dict(group=group, packed=True))

The argument types are upstream's (``vllm_ascend/distributed/weight_transfer/hccl_engine.py``): init
info with ``master_address``, ``master_port``, ``world_size`` (a dict, this module's
`HCCLWeightTransferInitInfo`, or any object with those attributes: upstream's, our worker's), and
`HCCLTrainerSendWeightsArgs` (or a dict of its fields). What travels is our protocol, not
upstream's raw per-tensor broadcasts: ``group`` is a `BroadcastTrainer`, each send carries the
manifest and the two votes, so the workers must be ours (the ``hccl`` engine of
``ascend_dist.weight_transfer.vllm_engine``, or `BroadcastWorker`).

Differences from upstream, each because the protocol needs it:

- ``trainer_send_weights`` lists the iterator before sending (names, dtypes and shapes go first, in
  the manifest); pass `BroadcastTrainer.send` a manifest to stream a generator instead.
- ``packed``, ``packed_buffer_size_bytes`` and ``packed_num_buffers`` default to the values given
  at ``trainer_init`` (upstream: ``False``, 1 GiB, 2), so a framework that sets none of them sends
  what workers initialised with the same dict expect; a value that differs from the workers' is
  refused by every rank with `ManifestRejected` naming it, before any byte moves.
- ``src`` must be 0 and ``rank_offset`` 1 (this trainer is the group's single rank 0); ``stream``
  is accepted and unused (the trainer orders its copies and collectives on its runtime's streams).
- The group holds a TCPStore and a communicator: call ``group.shutdown()`` when done (upstream's
  has no teardown).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ascend_dist.common.device import get_runtime
from ascend_dist.common.errors import ConfigError, format_allowed
from ascend_dist.weight_transfer.collective import gloo_collective, hccl_collective
from ascend_dist.weight_transfer.messages import (
    DEFAULT_BUFFER_SIZE_BYTES,
    DEFAULT_DIRECT_THRESHOLD_BYTES,
    DEFAULT_NUM_BUFFERS,
)
from ascend_dist.weight_transfer.trainer import BroadcastTrainer, manifest_of

if TYPE_CHECKING:
    import torch

__all__ = ["HCCLTrainerSendWeightsArgs", "HCCLWeightTransferEngine", "HCCLWeightTransferInitInfo"]

# Init-info fields read by trainer_init, with their defaults (None: required).
_INIT_FIELDS: dict[str, Any] = {
    "master_address": None,
    "master_port": None,
    "world_size": None,
    "rank_offset": 1,
    "packed": True,
    "packed_buffer_size_bytes": DEFAULT_BUFFER_SIZE_BYTES,
    "packed_num_buffers": DEFAULT_NUM_BUFFERS,
    "packed_direct_threshold_bytes": DEFAULT_DIRECT_THRESHOLD_BYTES,
    "op_timeout_s": 300.0,
    "streamed": False,
}
# Worker-only fields of the same init dict: accepted (a framework may pass one dict to both sides), unused here.
_WORKER_ONLY = frozenset({"layerwise_reload", "validate_names"})


@dataclass
class HCCLWeightTransferInitInfo:
    """Upstream's init info (its four fields first, in its order) plus our optional packing fields.

    The same values go to the workers' ``init_weight_transfer_engine`` (``dataclasses.asdict``); this
    copy needs no vLLM. `HCCLWeightTransferEngine.trainer_init` also takes a dict or any object
    with these attributes (upstream's dataclass, our vLLM engine's).
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
    streamed: bool = False


@dataclass
class HCCLTrainerSendWeightsArgs:
    """Arguments of `HCCLWeightTransferEngine.trainer_send_weights` (upstream's fields and order).

    Attributes:
        group: What `HCCLWeightTransferEngine.trainer_init` returned.
        src: The sending rank: must be 0.
        post_iter_func: Maps each ``(name, tensor)`` item to the tensor to send; None: the tensor.
        packed: Pack into buffers; None: the ``trainer_init`` value.
        stream: Accepted for upstream's signature; unused (see the module docstring).
        packed_buffer_size_bytes: Buffer size; None: the ``trainer_init`` value.
        packed_num_buffers: Buffers in flight; None: the ``trainer_init`` value.
    """

    group: Any  # a BroadcastTrainer; typed loosely because frameworks pass it through dicts
    src: int = 0
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    packed: bool | None = None
    stream: Any = None
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None


def _init_fields(init_info: Mapping[str, Any] | object) -> dict[str, Any]:
    """The init fields from a dict (unknown keys refused) or an object's attributes."""
    if isinstance(init_info, Mapping):
        unknown = sorted(set(init_info) - set(_INIT_FIELDS) - _WORKER_ONLY)
        if unknown:
            raise ConfigError("init_info", unknown, format_allowed(sorted(set(_INIT_FIELDS) | _WORKER_ONLY)))
        got = dict(init_info)
    else:
        got = {name: getattr(init_info, name) for name in _INIT_FIELDS if hasattr(init_info, name)}
    fields = {name: got.get(name, default) for name, default in _INIT_FIELDS.items()}
    for name, value in fields.items():
        if value is None:
            raise ConfigError(f"init_info.{name}", None, "a value (master_address, master_port, world_size)")
    if fields["rank_offset"] != 1:
        raise ConfigError("init_info.rank_offset", fields["rank_offset"], "1: this trainer is the group's only rank 0")
    return fields


def _send_args(trainer_args: HCCLTrainerSendWeightsArgs | Mapping[str, Any]) -> HCCLTrainerSendWeightsArgs:
    if isinstance(trainer_args, HCCLTrainerSendWeightsArgs):
        args = trainer_args
    elif isinstance(trainer_args, Mapping):
        names = [f.name for f in dataclasses.fields(HCCLTrainerSendWeightsArgs)]
        unknown = sorted(set(trainer_args) - set(names))
        if unknown or "group" not in trainer_args:
            raise ConfigError("trainer_args", unknown or "no 'group'", f"a dict with 'group' and only {names}")
        args = HCCLTrainerSendWeightsArgs(**trainer_args)
    else:
        raise ConfigError("trainer_args", type(trainer_args).__name__, "HCCLTrainerSendWeightsArgs or a dict")
    if not isinstance(args.group, BroadcastTrainer):
        raise ConfigError("trainer_args.group", type(args.group).__name__, "the group trainer_init returned")
    if args.src != 0:
        raise ConfigError("trainer_args.src", args.src, "0 (the trainer is rank 0 of the group)")
    return args


class HCCLWeightTransferEngine:
    """The trainer half of vllm-ascend's ``HCCLWeightTransferEngine``: its two static methods.

    The worker half is ``ascend_dist.weight_transfer.vllm_engine.HCCLWeightTransferEngine`` (the
    ``hccl`` engine vLLM runs); this class needs no vLLM.
    """

    @staticmethod
    def trainer_init(init_info: Mapping[str, Any] | object) -> BroadcastTrainer:
        """Host the transfer group as rank 0 and wait until every worker joined (upstream's call).

        Args:
            init_info: ``master_address``, ``master_port``, ``world_size`` (trainer + workers), and
                optionally the packing fields of our worker init info (``packed``,
                ``packed_buffer_size_bytes``, ``packed_num_buffers``,
                ``packed_direct_threshold_bytes``, ``op_timeout_s``, ``streamed``): a dict or an object.

        Returns:
            The group to pass as ``trainer_args["group"]``.

        Raises:
            ConfigError: A missing or unknown field, ``rank_offset`` other than 1, bad geometry.
            RuntimeError: A worker did not join within ``op_timeout_s`` (from the store).
        """
        f = _init_fields(init_info)
        runtime = get_runtime()  # the current device, as upstream's torch.accelerator.current_device_index()
        device = "cpu" if runtime.name == "cpu" else f"{runtime.name}:{runtime.device_index}"
        return BroadcastTrainer.connect(
            str(f["master_address"]), int(f["master_port"]), int(f["world_size"]), device=device,
            collective_factory=gloo_collective if runtime.name == "cpu" else hccl_collective,
            op_timeout_s=float(f["op_timeout_s"]), packed=bool(f["packed"]),
            buffer_size_bytes=int(f["packed_buffer_size_bytes"]), num_buffers=int(f["packed_num_buffers"]),
            direct_threshold_bytes=int(f["packed_direct_threshold_bytes"]), streamed=bool(f["streamed"]),
        )  # fmt: skip

    @staticmethod
    def trainer_send_weights(
        iterator: Iterable[tuple[str, torch.Tensor]], trainer_args: HCCLTrainerSendWeightsArgs | Mapping[str, Any]
    ) -> None:
        """Send one update (each worker runs its ``update_weights`` concurrently), as upstream's call.

        Args:
            iterator: ``(name, tensor)`` pairs in the order of the workers' update info.
            trainer_args: `HCCLTrainerSendWeightsArgs` or a dict of its fields.

        Raises:
            ConfigError: Bad ``trainer_args`` (unknown field, ``src`` not 0, not our group).
            ManifestRejected: A worker refused the update (names, shapes, packing differ); nothing changed.
            WorkerLost: A worker stopped responding; no worker committed.
            UpdateAborted: The collective failed with every worker alive; no worker committed.
        """
        args = _send_args(trainer_args)
        trainer: BroadcastTrainer = args.group
        post = args.post_iter_func if args.post_iter_func is not None else (lambda item: item[1])
        tensors = [(name, post((name, tensor))) for name, tensor in iterator]
        manifest = manifest_of(
            tensors,
            packed=trainer.packed if args.packed is None else args.packed,
            buffer_size_bytes=(
                trainer.buffer_size_bytes if args.packed_buffer_size_bytes is None else args.packed_buffer_size_bytes
            ),
            num_buffers=trainer.num_buffers if args.packed_num_buffers is None else args.packed_num_buffers,
            direct_threshold_bytes=trainer.direct_threshold_bytes,
            streamed=trainer.streamed,
        )
        trainer.send(tensors, manifest)
