"""vLLM's groups of one replica as a `load_vote.ReplicaExchange` (the npu_ipc load vote's rendezvous).

Runs in: vLLM worker processes, inside ``init_transfer_engine`` of the ``npu_ipc`` engine, which vLLM
calls on every worker of the replica together (so the collectives here line up on every rank).
"""

from __future__ import annotations

import torch

from ascend_dist.common.errors import ConfigError

__all__ = ["VllmReplicaExchange"]


class VllmReplicaExchange:
    """`ReplicaExchange` over vLLM's CPU groups of this worker's replica (its PP, PCP and TP groups).

    A replica's ranks are vLLM's ``(pp, pcp, tp)`` grid of one DP index; replica rank
    ``(pp * pcp_size + pcp) * tp_size + tp``, rank 0 at the origin. Used only inside
    ``init_transfer_engine``, which vLLM calls on every worker of the replica together.
    """

    _PAYLOAD_BYTES = 1024

    def __init__(self) -> None:
        """Read this worker's groups from vLLM's parallel state (initialised in every worker)."""
        from vllm.distributed import parallel_state

        pcp = getattr(parallel_state, "get_pcp_group", None)
        self._groups = [parallel_state.get_pp_group()] + ([pcp()] if pcp is not None else [])
        self._groups.append(parallel_state.get_tp_group())
        self.rank = 0
        for group in self._groups:
            self.rank = self.rank * group.world_size + group.rank_in_group
        self.world_size = 1
        for group in self._groups:
            self.world_size *= group.world_size

    def broadcast_from_first(self, payload: bytes) -> bytes:
        """Rank 0's payload on every rank: broadcast along PP, then PCP, then TP, each from its first rank."""
        import torch.distributed as dist

        if len(payload) > self._PAYLOAD_BYTES - 4:
            raise ConfigError("payload", len(payload), f"at most {self._PAYLOAD_BYTES - 4} bytes")
        buffer = torch.zeros(self._PAYLOAD_BYTES, dtype=torch.uint8)
        buffer[:4] = torch.tensor(list(len(payload).to_bytes(4, "little")), dtype=torch.uint8)
        if payload:  # (torch.frombuffer refuses an empty buffer; the other ranks send none)
            buffer[4 : 4 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        for group in self._groups:
            if group.world_size > 1:
                dist.broadcast(buffer, src=group.ranks[0], group=group.cpu_group)
        raw = bytes(buffer.tolist())
        return raw[4 : 4 + int.from_bytes(raw[:4], "little")]

    def all_true(self, flag: bool) -> bool:
        """The minimum over every group of the replica."""
        import torch.distributed as dist

        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        for group in self._groups:
            if group.world_size > 1:
                dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group.cpu_group)
        return bool(value.item())
