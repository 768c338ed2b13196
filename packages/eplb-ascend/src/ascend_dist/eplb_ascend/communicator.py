"""The EPLB expert-weight communicator core: vLLM's add_send/add_recv/execute contract over a `P2PTransport`.

Runs in: the worker. vLLM's ``rearrange_expert_weights_inplace`` calls ``add_send(tensors, dst_rank,
expert_id)`` / ``add_recv(tensors, src_rank, expert_id)`` for one layer, then ``execute()``. Ranks are
group-local; the transport maps them to global ranks. Each message is tagged with
``expert_id * weights_per_expert + k`` so sends and receives pair by expert, not by posting order.
No profile buffer reservation: buffers are taken lazily by the first real transfer (Ascend keeps
each expert as its own tensor, which vLLM's profile path, built for stacked tensors, cannot handle).
Tensors on a device are staged through CPU when the transport is CPU-only (gloo).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ascend_dist.common.errors import ConfigError
from ascend_dist.eplb_ascend.transport import P2POperation, P2PTransport

__all__ = ["ExpertTransferQueue"]


class ExpertTransferQueue:
    """Queued expert sends/receives, run as one batch by `execute`."""

    needs_profile_buffer_reservation = False

    def __init__(
        self,
        transport: P2PTransport,
        *,
        timeout_s: float = 30.0,
        require_standalone: bool = True,
        stage_through_cpu: bool = False,
    ) -> None:
        """Queue onto `transport`; `require_standalone` enforces storage offset 0 (HCCL's rule)."""
        if not timeout_s > 0:
            raise ConfigError("timeout_s", timeout_s, "a positive number of seconds")
        self.transport = transport
        self.timeout_s = timeout_s
        self.require_standalone = require_standalone
        self.stage_through_cpu = stage_through_cpu
        self._ops: list[P2POperation] = []
        self._unstage: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def pending(self) -> int:
        """Number of queued tensor ops."""
        return len(self._ops)

    def _check(self, tensors: Sequence[torch.Tensor], peer: int, expert_id: int, what: str) -> None:
        world, rank = self.transport.world_size, self.transport.rank
        if not 0 <= peer < world or peer == rank:
            raise ConfigError(what, peer, f"a group rank in [0, {world}) other than {rank}")
        if expert_id < 0:
            raise ConfigError("expert_id", expert_id, "a non-negative logical expert id")
        for k, t in enumerate(tensors):
            if self.require_standalone and t.storage_offset() != 0:
                raise ConfigError(
                    f"tensors[{k}].storage_offset()", t.storage_offset(), "0 (each expert its own tensor)"
                )
            if not t.is_contiguous():
                raise ConfigError(f"tensors[{k}]", "non-contiguous", "a contiguous tensor")

    def add_send(self, tensors: Sequence[torch.Tensor], dst_rank: int, expert_id: int) -> None:
        """Queue a send of every tensor of one expert (the tensor objects themselves, no copy)."""
        self._check(tensors, dst_rank, expert_id, "dst_rank")
        n = len(tensors)
        for k, t in enumerate(tensors):
            src = t.cpu() if self.stage_through_cpu and t.device.type != "cpu" else t
            if src.storage_offset() != 0:  # a view into stacked experts: device transports send whole storages
                src = src.clone()
            self._ops.append(P2POperation("send", src, dst_rank, expert_id * n + k))

    def add_recv(self, tensors: Sequence[torch.Tensor], src_rank: int, expert_id: int) -> None:
        """Queue a receive of every tensor of one expert into the given tensors."""
        self._check(tensors, src_rank, expert_id, "src_rank")
        n = len(tensors)
        for k, t in enumerate(tensors):
            dst = t
            if self.stage_through_cpu and t.device.type != "cpu":
                dst = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                self._unstage.append((t, dst))
            elif t.storage_offset() != 0:  # a view (allowed without require_standalone): receive whole, copy in
                dst = torch.empty_like(t)
                self._unstage.append((t, dst))
            self._ops.append(P2POperation("recv", dst, src_rank, expert_id * n + k))

    def execute(self) -> None:
        """Run every queued op within the deadline; the queue is cleared even when the batch raises."""
        if not self._ops:
            return
        try:
            self.transport.batch_send_recv(self._ops, self.timeout_s)
            for dst, staged in self._unstage:
                dst.copy_(staged)
        finally:
            self._ops.clear()
            self._unstage.clear()
