"""What the pull scheduler hands its workers each step (the scheduler-to-worker half of the metadata).

Runs in: built by `pull.scheduler` in the scheduler process, carried to the workers inside vLLM's
connector metadata, read by `pull.worker`, `pull.threads`, `pull.d_requests` and the planning
modules. Kept apart from the scheduler so that worker-side and planning code need not import it.
"""

from __future__ import annotations

import msgspec

from ascend_dist.kv_mooncake.core.capability import Capability, Grant

__all__ = ["PullMetadata", "ReqMeta", "pull_capability", "pull_grant", "rank_host"]


class ReqMeta(msgspec.Struct, frozen=True, kw_only=True):
    """One pull for the D workers (or an empty receive, when ``local_block_ids`` are all empty)."""

    request_id: str
    local_block_ids: list[list[int]]
    remote_block_ids: list[list[int]]
    num_computed_tokens: int
    remote_request_id: str
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_ptp_size: int
    do_virtual: bool = False
    prompt_len: int = 0
    window_blocks: list[int] = []
    state_groups: list[int] = []
    num_speculative_tokens: int = 0
    remote_block_size: int = 0
    # Only tells P to free (the request is not waiting on D): never reported in finished_recving, since
    # vLLM asserts that a finished receive belongs to a request it still holds.
    notify_only: bool = False
    # P's signed capability over (remote_request_id, remote_engine_id, remote_block_ids, prompt_digest,
    # capability_expires_ms), as the params carried it ("" = unsigned): checked by D before any read
    # and presented to P in every Renew and Done (`core.capability`).
    prompt_digest: str = ""
    capability: str = ""
    capability_expires_ms: int = 0
    # Host of P's port remote_port + i ("" or past the end: remote_host): a P instance spanning nodes.
    remote_rank_hosts: list[str] = []


def rank_host(meta: ReqMeta, port: int) -> str:
    """The host of P's side channel and Mooncake segment on ``port`` (one of the instance's ports)."""
    i = port - meta.remote_port
    hosts = meta.remote_rank_hosts
    return (hosts[i] if 0 <= i < len(hosts) else "") or meta.remote_host


def pull_capability(meta: ReqMeta) -> Capability:
    """The capability ``meta``'s params claim (what P must have signed for this pull to go ahead)."""
    return Capability(
        meta.remote_request_id,
        meta.remote_engine_id,
        [list(ids) for ids in meta.remote_block_ids],
        meta.prompt_digest,
        meta.capability_expires_ms,
        list(meta.remote_rank_hosts),
    )


def pull_grant(meta: ReqMeta) -> Grant | None:
    """What D presents to P in ``Renew`` and ``Done`` (None when the params were unsigned)."""
    return Grant(capability=pull_capability(meta), tag=meta.capability) if meta.capability else None


class PullMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """One step's work for the workers: D's pulls, P's delayed frees, the batch's ids, P's drops.

    ``to_drop``: P requests that ended without lending their blocks (stopped, aborted, nothing
    to send); P's workers forget them (they were announced in an earlier step's ``in_batch``).
    """

    requests: dict[str, ReqMeta] = {}
    to_send: list[str] = []
    in_batch: list[str] = []
    to_drop: list[str] = []
