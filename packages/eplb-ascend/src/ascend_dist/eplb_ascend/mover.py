"""Expert-weight movement: apply a `TransferPlan` to this rank's expert tensors, all or nothing.

Runs in: the worker, on every EP rank at once (collective). Each expert of each layer is its own
tensor at storage offset 0 (``weights[layer][local_slot][k]``), the layout Ascend keeps, so whole
tensors are sent as they are. Order of a rearrangement:

1. all ranks exchange a fingerprint (layer/slot/weight counts, shapes, dtypes, old and new placement)
   and refuse with `IncompatiblePeer` naming the first differing field;
2. received experts land in staging buffers, and slots read by local copies are staged, while the
   live weights stay untouched;
3. all ranks vote; only when every rank received everything are the staged experts copied into the
   live tensors (same storage, same addresses). A timeout, a failed transfer or a "no" vote raises
   and leaves the old placement valid and in use.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ascend_dist.common.errors import ConfigError, IncompatiblePeer, TransferError
from ascend_dist.eplb_ascend.placement import IntArray
from ascend_dist.eplb_ascend.transfer_plan import TransferPlan
from ascend_dist.eplb_ascend.transport import P2POperation, P2PTransport

__all__ = ["FINGERPRINT_FIELDS", "ExpertWeightMover", "MoveStats", "check_expert_weights"]

logger = logging.getLogger(__name__)

ExpertWeights = Sequence[Sequence[Sequence[torch.Tensor]]]
FINGERPRINT_FIELDS = (
    "num_layers",
    "slots_per_rank",
    "weights_per_expert",
    "shapes",
    "dtypes",
    "old_placement",
    "new_placement",
)


@dataclass(frozen=True)
class MoveStats:
    """What one rearrangement moved on this rank."""

    bytes_sent: int
    bytes_received: int
    bytes_copied_locally: int
    experts_received: int
    seconds: float
    transfer_seconds: float


def check_expert_weights(weights: ExpertWeights, slots_per_rank: int, *, require_standalone: bool = True) -> None:
    """Validate ``weights[layer][local_slot][k]``: slot counts, uniform shapes per k, offset 0, contiguity.

    Raises:
        ConfigError: naming the first offending ``weights[l][s][k]``.
    """
    for layer, slots in enumerate(weights):
        if len(slots) != slots_per_rank:
            raise ConfigError(f"weights[{layer}]", f"{len(slots)} slots", f"{slots_per_rank} local slots")
        ref = slots[0]
        for slot, tensors in enumerate(slots):
            if len(tensors) != len(ref):
                raise ConfigError(f"weights[{layer}][{slot}]", f"{len(tensors)} tensors", f"{len(ref)} like slot 0")
            for k, (t, r) in enumerate(zip(tensors, ref, strict=True)):
                where = f"weights[{layer}][{slot}][{k}]"
                if t.shape != r.shape or t.dtype != r.dtype:
                    raise ConfigError(where, f"{tuple(t.shape)} {t.dtype}", f"{tuple(r.shape)} {r.dtype} like slot 0")
                if not t.is_contiguous():
                    raise ConfigError(where, "non-contiguous", "a contiguous tensor")
                if require_standalone and t.storage_offset() != 0:
                    raise ConfigError(f"{where}.storage_offset()", t.storage_offset(), "0 (each expert its own tensor)")


def _hash64(data: bytes) -> int:
    """A signed 64-bit digest (fits an int64 tensor)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _fingerprint(weights: ExpertWeights, slots_per_rank: int, old: IntArray, new: IntArray) -> torch.Tensor:
    first = weights[0][0] if weights and weights[0] else []
    shapes = ";".join(",".join(map(str, t.shape)) for t in first)
    dtypes = ";".join(str(t.dtype) for t in first)
    values = [
        len(weights), slots_per_rank, len(first), _hash64(shapes.encode()), _hash64(dtypes.encode()),
        _hash64(np.ascontiguousarray(old, dtype=np.int64).tobytes()),
        _hash64(np.ascontiguousarray(new, dtype=np.int64).tobytes()),
    ]  # fmt: skip
    return torch.tensor(values, dtype=torch.int64)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ExpertWeightMover:
    """Moves expert weights between EP ranks through a `P2PTransport` (gloo on CPU, HCCL on Ascend)."""

    def __init__(self, transport: P2PTransport, *, timeout_s: float = 30.0, require_standalone: bool = True) -> None:
        """Bind to a transport; every rearrangement must finish within `timeout_s` per phase."""
        if not timeout_s > 0:
            raise ConfigError("timeout_s", timeout_s, "a positive number of seconds")
        self.transport = transport
        self.timeout_s = timeout_s
        self.require_standalone = require_standalone

    def check_peers(self, weights: ExpertWeights, slots_per_rank: int, old: IntArray, new: IntArray) -> None:
        """Collective: every rank must agree on shapes and placements. Raises IncompatiblePeer."""
        mine = _fingerprint(weights, slots_per_rank, old, new)
        seen = self.transport.all_gather_int64(mine, self.timeout_s)
        for peer, row in enumerate(seen):
            differs = (row != mine).nonzero()
            if differs.numel():
                i = int(differs[0, 0])
                raise IncompatiblePeer(f"{FINGERPRINT_FIELDS[i]} (rank {peer})", int(mine[i]), int(row[i]))

    def apply(self, plan: TransferPlan, old: IntArray, new: IntArray, weights: ExpertWeights) -> MoveStats:
        """Collective: move this rank's share of `plan` and commit it only if every rank succeeded."""
        start = time.perf_counter()
        rank = self.transport.rank
        check_expert_weights(weights, plan.slots_per_rank, require_standalone=self.require_standalone)
        self.check_peers(weights, plan.slots_per_rank, old, new)
        local = plan.local_slot
        staged_recv: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        ops: list[P2POperation] = []
        sent = received = 0
        for tag, move in plan.sends_for(rank):
            tensors = weights[move.layer][local(move.src_slot)]
            nw = len(tensors)
            ops.extend(P2POperation("send", t, move.dst_rank, tag * nw + k) for k, t in enumerate(tensors))
            sent += _nbytes(tensors)
        for tag, move in plan.recvs_for(rank):
            live = list(weights[move.layer][local(move.dst_slot)])
            buffers = [torch.empty_like(t) for t in live]
            nw = len(buffers)
            ops.extend(P2POperation("recv", b, move.src_rank, tag * nw + k) for k, b in enumerate(buffers))
            staged_recv.append((live, buffers))
            received += _nbytes(buffers)
        copies = plan.copies_for(rank)
        staged_old = {
            (c.layer, c.src_slot): [t.clone() for t in weights[c.layer][local(c.src_slot)]]
            for c in copies
            if c.from_old
        }
        error: Exception | None = None
        transfer_start = time.perf_counter()
        try:
            self.transport.batch_send_recv(ops, self.timeout_s)
        except Exception as exc:  # vote "no", then re-raise below: peers must not commit either
            error = exc
        transfer_seconds = time.perf_counter() - transfer_start
        self._vote(error)
        copied = 0
        for live, buffers in staged_recv:
            for dst, src in zip(live, buffers, strict=True):
                dst.copy_(src)
        for c in copies:
            srcs = staged_old[(c.layer, c.src_slot)] if c.from_old else weights[c.layer][local(c.src_slot)]
            for dst, src in zip(weights[c.layer][local(c.dst_slot)], srcs, strict=True):
                dst.copy_(src)
                copied += dst.numel() * dst.element_size()
        seconds = time.perf_counter() - start
        return MoveStats(sent, received, copied, len(staged_recv), seconds, transfer_seconds)

    def _vote(self, error: Exception | None) -> None:
        """All-gather one ok flag per rank; commit only when every flag is 1. Re-raises a local error."""
        mine = torch.tensor([0 if error else 1], dtype=torch.int64)
        try:
            # A slower rank may spend up to timeout_s in its own transfer phase before it votes.
            votes = self.transport.all_gather_int64(mine, 2 * self.timeout_s)
        except Exception:
            if error is not None:  # the transfer error explains more than the vote that followed it
                raise error from None
            raise
        if error is not None:
            raise error
        failed = [r for r, v in enumerate(votes[:, 0].tolist()) if v != 1]
        if failed:
            raise TransferError(f"rearrangement aborted: ranks {failed} failed to receive their experts")
