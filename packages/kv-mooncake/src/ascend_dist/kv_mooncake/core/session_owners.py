"""Which peer process each Mooncake session name stands for in this process (TCP transport).

Runs in: worker processes that move bytes with a peer's session (one table per process: every
connector shares Mooncake's one engine): the pull's D before each read, the layer-wise push's P
before writing with a D's metadata.

Why: Mooncake's engine fetches a peer's segment descriptor (its transport port and memory) the
first time it transfers to a session name ``host:rpc_port`` and keeps it for the life of the
process. Over TCP nothing refreshes it (measured with 0.3.13: the Python binding has no call for
it, ``send_probe`` does not; ``MC_TE_METADATA_REFRESH_INTERVAL_SECONDS`` polls every peer ever
seen, dead ones included, every interval and logs each failure; ``MC_DISABLE_METACACHE`` fetches
it for every piece, 7-14x slower). A P that restarts and draws the RPC port of an earlier P this
process read (ports are drawn from 15000-16999, or pinned by the operator) is then read through
the dead one's descriptor, and a D restarted the same way is written through it by a push P.
Where the new peer also took the dead one's transport port (Mooncake draws both from one range,
so a restart often does) the transfer reaches it and is right (the addresses come from our own
metadata; measured). Where the transport port differs, every transfer fails after a second of
reconnecting to the old port, or reaches whatever process listens there now. So a later owner of
a session name is transferred with only if it listens on the first owner's transport ports;
otherwise its requests fail at once, without moving a byte, and are recomputed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ascend_dist.common.errors import TransferError

__all__ = ["SESSION_OWNERS", "SessionOwners", "SessionReused", "session_owners_for"]


class SessionReused(TransferError):
    """A peer process took a session name this process's Mooncake engine knows as another process's."""


class SessionOwners:
    """The owner (`AgentMetadata.owner`) and transport ports each session name was first claimed for."""

    def __init__(self) -> None:
        """An empty table."""
        self._lock = threading.Lock()
        self._first: dict[str, tuple[str, tuple[int, ...]]] = {}

    def claim(self, session: str, owner: str, transport_ports: Sequence[int]) -> None:
        """Record ``owner`` and its ``transport_ports`` for ``session`` before moving bytes with it.

        Raises:
            SessionReused: ``session`` was first claimed for another owner on other transport ports
                (Mooncake would send the read to those).
        """
        ports = tuple(transport_ports)
        with self._lock:
            first, first_ports = self._first.setdefault(session, (owner, ports))
        if first != owner and first_ports != ports:
            raise SessionReused(
                f"Mooncake session {session} now belongs to {owner} on transport ports {list(ports)}, but "
                f"this process's Mooncake engine knows it as {first} on {list(first_ports)} and keeps that "
                "descriptor for its life (Mooncake over TCP does not refresh it): nothing moved, recomputed. "
                "Restart that peer on another Mooncake RPC port (MC_MIN_RPC_PORT/MC_MAX_RPC_PORT) or restart "
                "this process",
                peer=session,
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._first)


SESSION_OWNERS = SessionOwners()
"""This process's table (every receiver in the process reads through Mooncake's one engine)."""


def session_owners_for(protocol: str) -> SessionOwners | None:
    """The table a connector moving bytes over Mooncake ``protocol`` checks sessions against, or None.

    Measured over TCP: Mooncake never refreshes a peer's descriptor. Its RDMA transport refetches
    one after a remote failure (per its source; not measured here), so nothing is checked there.
    """
    return SESSION_OWNERS if protocol == "tcp" else None
