"""The load vote of the npu_ipc path: every rank of a replica keeps an update, or every rank restores.

Runs in: inference-worker processes of one vLLM replica (its TP x PP ranks), npu_ipc backend.

Each rank of an npu_ipc engine is driven by its own RPC, so without a vote a loader failing on one
rank leaves the others on the new weights. After loading a staged update each rank reports whether
its loader succeeded; the ranks then follow one outcome, ``commit`` or ``restore``, and on
``restore`` every rank puts back the host copy of its model it took before loading.

The vote runs over a `torch.distributed.TCPStore` hosted by rank 0 of the replica on 127.0.0.1
(`replica_store`): keys only, no collective, so a rank that never comes (dead, or it dropped the
update earlier) cannot leave a half-done operation in any group, and every wait is a deadline.
The outcome key is written once with ``compare_set`` (the first writer wins), so a rank that gave
up waiting and chose ``restore`` can never be contradicted by a late rank that saw every vote:
each rank reads and follows the stored outcome. Keys are named by the trainer's random
``update_id``, so two updates never share a key. Values are JSON, never pickle.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ascend_dist.common.errors import ConfigError
from ascend_dist.weight_transfer.errors import UpdateStateError

__all__ = [
    "LoadVote",
    "ReplicaExchange",
    "StoreLoadVote",
    "VoteOutcome",
    "node_identity",
    "replica_store",
]

logger = logging.getLogger(__name__)

_POLL_S = 0.002  # between looks at the store while waiting for peers (a local TCP round trip each)


@dataclass(frozen=True)
class VoteOutcome:
    """What every rank of the replica does with a loaded update.

    Attributes:
        commit: True when every rank loaded it; False: every rank restores.
        failures: Rank -> why (the rank's loader error, or that it did not vote in time).
    """

    commit: bool
    failures: dict[int, str] = field(default_factory=dict)

    def describe(self) -> str:
        """The failing ranks and their reasons, for error messages."""
        return "; ".join(f"rank {rank}: {why}" for rank, why in sorted(self.failures.items()))


@runtime_checkable
class LoadVote(Protocol):
    """The cross-rank agreement on one update (all ranks of the replica vote on every staged update)."""

    rank: int
    world_size: int

    def vote(self, update_id: str, failure: str | None) -> VoteOutcome:
        """Report this rank's load (None: it loaded) and return the outcome every rank follows.

        Returns at once when another rank already reported a failure; otherwise when every rank
        voted, or at the deadline (then ``restore``, naming the ranks that did not vote).
        """
        ...

    def withdraw(self, update_id: str, reason: str) -> None:
        """Vote no without waiting: this rank dropped the update before loading it (peers fail at once)."""
        ...

    def close(self) -> None:
        """Release the store connection (rank 0: the store itself); idempotent."""
        ...


class StoreLoadVote:
    """`LoadVote` over a TCPStore every rank of the replica can reach."""

    def __init__(self, store: Any, rank: int, world_size: int, *, timeout_s: float = 300.0) -> None:
        """Vote over ``store`` (a ``torch.distributed.Store``) as ``rank`` of ``world_size``.

        Raises:
            ConfigError: Bad rank, world size or timeout.
        """
        if world_size < 1:
            raise ConfigError("world_size", world_size, "at least 1")
        if not 0 <= rank < world_size:
            raise ConfigError("rank", rank, f"0..{world_size - 1}")
        if timeout_s <= 0:
            raise ConfigError("vote_timeout_s", timeout_s, "a positive number of seconds")
        self._store: Any = store  # None once closed: a vote then raises, and the caller restores
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._recent: list[str] = []  # update ids this rank voted on, newest last (at most 3)

    @staticmethod
    def _rank_key(update_id: str, rank: int) -> str:
        return f"load-vote/{update_id}/rank/{rank}"

    @staticmethod
    def _outcome_key(update_id: str) -> str:
        return f"load-vote/{update_id}/outcome"

    def _live(self) -> Any:
        if self._store is None:
            raise UpdateStateError("the load vote is closed (the engine was shut down)")
        return self._store

    def _record(self, update_id: str, failure: str | None) -> None:
        value = json.dumps({"ok": failure is None, "why": failure or ""})
        self._live().compare_set(self._rank_key(update_id, self.rank), "", value)  # a rank votes once
        self._forget_previous(update_id)

    def _forget_previous(self, update_id: str) -> None:
        """Delete this rank's keys of the update two before this one.

        vLLM's collective RPC returns only when every rank returned, so the trainer sends an update
        only after every rank left the vote before it; two back leaves a margin on top of that.
        """
        if update_id in self._recent:
            return
        self._recent.append(update_id)
        if len(self._recent) <= 2:
            return
        old = self._recent.pop(0)
        self._live().delete_key(self._rank_key(old, self.rank))
        if self.rank == 0:
            self._live().delete_key(self._outcome_key(old))

    def withdraw(self, update_id: str, reason: str) -> None:
        """Vote no for an update this rank dropped before loading it."""
        self._record(update_id, f"dropped the update before loading it ({reason})")

    def vote(self, update_id: str, failure: str | None) -> VoteOutcome:
        """Report this rank's load and follow the replica's one outcome (see `LoadVote.vote`)."""
        self._record(update_id, failure)
        store = self._live()
        keys = [self._rank_key(update_id, r) for r in range(self.world_size)]
        votes: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout_s
        proposal: VoteOutcome | None = None
        while proposal is None:
            decided = self._stored_outcome(update_id)
            if decided is not None:
                return decided
            for r, key in enumerate(keys):
                if r not in votes and store.check([key]):
                    votes[r] = _parse_vote(store.get(key))
            failures = {r: v["why"] for r, v in votes.items() if not v["ok"]}
            if failures or len(votes) == self.world_size:
                proposal = VoteOutcome(commit=not failures, failures=failures)
            elif time.monotonic() >= deadline:
                missing = sorted(set(range(self.world_size)) - votes.keys())
                why = f"did not report its load within vote_timeout_s={self.timeout_s:g} s"
                proposal = VoteOutcome(commit=False, failures=dict.fromkeys(missing, why))
            else:
                time.sleep(_POLL_S)
        stored = store.compare_set(self._outcome_key(update_id), "", _encode_outcome(proposal))
        return _decode_outcome(stored)

    def _stored_outcome(self, update_id: str) -> VoteOutcome | None:
        key, store = self._outcome_key(update_id), self._live()
        return _decode_outcome(store.get(key)) if store.check([key]) else None

    def close(self) -> None:
        """Drop the store (rank 0 stops serving it: a peer still voting then fails and restores)."""
        self._store = None


def _parse_vote(raw: bytes) -> dict[str, Any]:
    try:
        vote = json.loads(raw)
        if isinstance(vote, dict) and isinstance(vote.get("ok"), bool) and isinstance(vote.get("why"), str):
            return vote
    except ValueError:
        pass
    return {"ok": False, "why": f"unreadable vote {raw[:80]!r}"}  # never commit on what we cannot read


def _encode_outcome(outcome: VoteOutcome) -> str:
    return json.dumps({"commit": outcome.commit, "failures": {str(r): w for r, w in outcome.failures.items()}})


def _decode_outcome(raw: bytes) -> VoteOutcome:
    try:
        data = json.loads(raw)
        failures = {int(r): str(w) for r, w in data["failures"].items()}
        return VoteOutcome(commit=data["commit"] is True and not failures, failures=failures)
    except (ValueError, KeyError, TypeError, AttributeError):
        return VoteOutcome(commit=False, failures={-1: f"unreadable outcome {raw[:80]!r}"})


@runtime_checkable
class ReplicaExchange(Protocol):
    """What `replica_store` needs from the replica's ranks (vLLM: its TP and PP CPU groups)."""

    rank: int
    world_size: int

    def broadcast_from_first(self, payload: bytes) -> bytes:
        """Every rank gets rank 0's ``payload`` (collective: every rank calls it together)."""
        ...

    def all_true(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on every rank (collective)."""
        ...


def node_identity() -> str:
    """Which loopback this process sees: boot id, host name and network namespace (same value: 127.0.0.1 is shared)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "?"
    return f"{boot}/{socket.gethostname()}/{netns}"


def replica_store(exchange: ReplicaExchange, *, timeout_s: float = 60.0) -> Any | None:
    """Host (rank 0) or join the replica's vote store on 127.0.0.1; None when a rank is on another node.

    Collective over the replica. Rank 0 binds a free port on 127.0.0.1 only (the TCPStore on its own
    would listen on every interface) and tells the others the port and its node; a vote needs every
    rank on rank 0's loopback, so when any rank is elsewhere no rank votes (each then restores only
    its own part of a failed load and refuses to run, as without a vote).

    Raises:
        ConfigError: The store could not be joined within ``timeout_s``.
    """
    import torch.distributed as dist

    listen: socket.socket | None = None
    if exchange.rank == 0:
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.bind(("127.0.0.1", 0))
        listen.listen(socket.SOMAXCONN)
        offer = json.dumps({"port": listen.getsockname()[1], "node": node_identity()}).encode()
    else:
        offer = b""
    try:
        told = json.loads(exchange.broadcast_from_first(offer))
        local = told["node"] == node_identity()
        if not exchange.all_true(local):
            logger.warning(
                "npu_ipc: the ranks of this replica are not all on one node's loopback; a loader failing on "
                "one rank leaves that rank restored and refusing to run (no cross-rank load vote)"
            )
            return None
        wait = datetime.timedelta(seconds=timeout_s)
        if listen is not None:
            store = dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
                "127.0.0.1", told["port"], None, True, timeout=wait, wait_for_workers=False,
                master_listen_fd=listen.detach(),
            )  # fmt: skip
        else:
            store = dist.TCPStore("127.0.0.1", int(told["port"]), None, False, timeout=wait)  # pyright: ignore[reportPrivateImportUsage]
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError("load vote store", "127.0.0.1", f"a store every rank joins ({exc})") from exc
    finally:
        if listen is not None and listen.fileno() >= 0:
            listen.close()
    return store
