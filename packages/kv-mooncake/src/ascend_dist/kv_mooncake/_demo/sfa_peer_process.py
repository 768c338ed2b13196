"""Start and drive an SFA P child (`ascend_dist.kv_mooncake._demo.sfa_peer`) with a deadline on every reply.

Runs in: the ``pd-sfa`` scenario and the tests (the parent side). Reuses the pull connector's
`PeerProcess` (JSON lines, deadlines, terminate-then-kill on close) with another child module.
"""

from __future__ import annotations

from typing import Any

from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess

__all__ = ["SfaP", "SfaPeer"]


class SfaPeer(PeerProcess):
    """A ``python -m ascend_dist.kv_mooncake._demo.sfa_peer`` child."""

    def __init__(self, *, ready_timeout_s: float = 60.0, rpc_ports: tuple[int, int] | None = None) -> None:
        """Start the child and wait until it reports ready (``rpc_ports``: see `PeerProcess`)."""
        super().__init__(
            module="ascend_dist.kv_mooncake._demo.sfa_peer", ready_timeout_s=ready_timeout_s, rpc_ports=rpc_ports
        )

    def create_p(self, name: str, config: dict[str, Any], model: dict[str, Any]) -> SfaP:
        """Create a P instance in the child."""
        self.call({"cmd": "create", "name": name, "config": config, "model": model}, timeout_s=60.0)
        return SfaP(self, name)


class SfaP:
    """One P instance inside an `SfaPeer`."""

    def __init__(self, peer: SfaPeer, name: str) -> None:
        """Bind to an instance created by `SfaPeer.create_p`."""
        self.peer = peer
        self.name = name

    def prefill(self, items: list[dict[str, Any]], timeout_s: float = 60.0) -> list[int]:
        """Run prefills (``rid, prompt_len, seed, params, chunk``); returns steps per request."""
        return list(self.peer.call({"cmd": "prefill", "name": self.name, "items": items}, timeout_s=timeout_s)["steps"])

    def prefill_batch(self, items: list[dict[str, Any]], timeout_s: float = 60.0) -> int:
        """Prefill the requests together, one forward per step; returns the steps run."""
        reply = self.peer.call({"cmd": "prefill_batch", "name": self.name, "items": items}, timeout_s=timeout_s)
        return int(reply["steps"][0])

    def drain(self, timeout_s: float = 90.0, *, take: bool = True) -> dict[str, Any]:
        """Wait until P's gates are open; returns ``{"failed": {...}, "sent": n}`` (``take=False``: failures kept)."""
        return self.peer.call({"cmd": "drain", "name": self.name, "take": take}, timeout_s=timeout_s)

    def held(self) -> dict[str, int]:
        """What P and its process hold (`sfa_peer`'s ``held``)."""
        return {k: int(v) for k, v in self.peer.call({"cmd": "held", "name": self.name}).items()}

    def mooncake_ports(self) -> tuple[int, list[int]]:
        """``(RPC port, transport ports)`` of the child's Mooncake engine."""
        reply = self.peer.call({"cmd": "engine", "name": self.name})
        return int(str(reply["session"]).rsplit(":", 1)[1]), [int(p) for p in reply["transport_ports"]]

    def kill(self) -> None:
        """SIGKILL the whole child process (every instance in it dies)."""
        self.peer.kill()

    def drop(self) -> None:
        """Shut the instance down (no-op when the process is gone)."""
        if self.peer.proc.poll() is None:
            self.peer.call({"cmd": "drop", "name": self.name})
