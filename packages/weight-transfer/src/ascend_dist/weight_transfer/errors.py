"""Typed errors of the weight-transfer package, all under `AscendDistError`.

Runs in: trainer and inference-worker processes.

Each class says how a caller should degrade.
"""

from __future__ import annotations

from ascend_dist.common.errors import AscendDistError, ProtocolError, TransferError

__all__ = [
    "EngineRpcFailed",
    "LoadFailed",
    "LoadRestored",
    "ManifestMismatch",
    "ManifestRejected",
    "PartialUpdate",
    "UpdateAborted",
    "UpdateStateError",
    "WeightsInconsistent",
    "WorkerLost",
]


class ManifestMismatch(ProtocolError):
    """The two sides disagree on what an update carries (tensor list, buffer geometry, mode).

    Raised before any weight is written. Degrade: fix the trainer or worker configuration named in
    the message and send the update again; the model still holds its previous weights.
    """


class ManifestRejected(ManifestMismatch):
    """A worker refused the trainer's manifest at the vote, before any data moved.

    The transfer group is still usable: fix the difference and send again.
    """


class UpdateStateError(AscendDistError, RuntimeError):
    """A weight-update call came in the wrong order (second start, update without start, ...).

    Degrade: call `finish_weight_update` or `abort` as the message says, then start over.
    """


class UpdateAborted(TransferError):
    """An update did not complete on every rank, so no rank committed it.

    The model keeps its previous weights. Degrade: re-initialise the transfer group (a broken
    collective cannot be reused) and send the update again.
    """


class WorkerLost(UpdateAborted):
    """One or more inference workers stopped responding during an update.

    Attributes:
        ranks: Transfer-group ranks of the workers that were lost.
    """

    def __init__(self, message: str, *, ranks: tuple[int, ...]) -> None:
        """Record the lost ranks in the error and its message."""
        super().__init__(message, peer=",".join(str(r) for r in ranks))
        self.ranks = ranks


class LoadFailed(TransferError):
    """The model's own loader failed after every rank committed the update (its error is the cause).

    The names were checked against the model at the vote, so this is a loader fault (a wrong shape
    for a sharded parameter, a quantisation loader error). The model may hold some new and some old
    weights, or layers left on the meta device by vLLM's layer-wise reload. Degrade: do not serve
    from this engine; send a complete update again or restart it.
    """


class EngineRpcFailed(TransferError):
    """The engines' side of an init or update (the client's RPC) failed; the server's error is the cause.

    Degrade: read the cause (the engine names what it refused), fix it and call init or send again.
    """


class PartialUpdate(LoadFailed):
    """A streamed update broke on the wire after this worker had loaded some of its buckets.

    Streamed updates load each bucket as it lands (bounded memory), so unlike a staged update the
    model now holds some new and some old weights, and the transfer group is unusable. Degrade: do
    not serve from this engine; call ``init`` again and send a complete update.
    """


class LoadRestored(UpdateAborted):
    """The model's loader failed after the commit vote on some rank, and every rank restored its previous weights.

    Every rank (the trainer included) learns it at a vote after the load; each worker put back the
    host copy of its model it took before loading, so no rank serves the new weights and none serves
    a mix. The transfer group is still usable. Degrade: read the cause (the failing rank's loader
    error), fix the update and send it again.
    """


class WeightsInconsistent(TransferError):
    """The model may hold a mix of two updates' weights, so it refuses to run.

    Raised by every forward of a guarded model (`guard.WeightsGuard`) after an update left mixed
    weights: a streamed update that broke after loading some buckets (`PartialUpdate`), a loader
    failure that could not be undone (`LoadFailed`), or one rank of several that undid its own part
    while the others loaded. The message names that cause. Degrade: send a complete update again;
    the model runs again once one succeeds on this rank.
    """
