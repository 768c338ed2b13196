"""A deadlock-free issue order for point-to-point ops on a communicator without grouping (pure Python).

Runs in: any process. A device communicator whose `send`/`recv` rendezvous with the peer (HCCL
``HcclSend``/``HcclRecv`` on one stream, without ``HcclBatchSendRecv``) deadlocks when two ranks
both send first, or when waits form a cycle. Issued in this order they cannot:

- rounds of a round-robin tournament (circle method): in each round every rank has at most one
  partner, and all ranks walk the rounds in the same order;
- within a round the lower rank of the pair sends first and then receives, the higher rank receives
  first and then sends;
- ops with the same peer and kind keep their original order, so the k-th send from A to B meets
  the k-th receive at B from A (per-pair FIFO, no tags needed).
"""

from __future__ import annotations

from collections.abc import Sequence

from ascend_dist.common.errors import ConfigError

__all__ = ["partner_rounds", "rendezvous_order"]


def partner_rounds(rank: int, world: int) -> list[int | None]:
    """This rank's partner in each round (None: sits out); every pair meets exactly once."""
    size = world + (world % 2)  # a dummy rank `world` when odd
    ring = list(range(1, size))
    partners: list[int | None] = []
    for _ in range(size - 1):
        table = [0, *ring]
        pairs = {table[i]: table[size - 1 - i] for i in range(size)}
        mate = pairs[rank]
        partners.append(None if mate >= world else mate)
        ring = ring[-1:] + ring[:-1]
    return partners


def rendezvous_order(kinds_and_peers: Sequence[tuple[str, int]], rank: int, world: int) -> list[int]:
    """Indices of `kinds_and_peers` (``("send"|"recv", peer)``) in a deadlock-free issue order.

    Raises:
        ConfigError: a peer outside ``[0, world)``, this rank itself, or a kind other than send/recv.
    """
    for kind, peer in kinds_and_peers:
        if not 0 <= peer < world or peer == rank:
            raise ConfigError("peer", peer, f"a group rank in [0, {world}) other than {rank}")
        if kind not in {"send", "recv"}:
            raise ConfigError("kind", kind, "'send' or 'recv'")
    by_peer: dict[int, tuple[list[int], list[int]]] = {}
    for index, (kind, peer) in enumerate(kinds_and_peers):
        sends, recvs = by_peer.setdefault(peer, ([], []))
        (sends if kind == "send" else recvs).append(index)
    order: list[int] = []
    for partner in partner_rounds(rank, world):
        if partner is None or partner not in by_peer:
            continue
        sends, recvs = by_peer[partner]
        order.extend(sends + recvs if rank < partner else recvs + sends)
    return order
