"""Errors specific to ascend_dist.eplb_ascend (all derive from ascend_dist.common.errors).

Runs in: any process. Bad placements are `ConfigError`s (also `ValueError`), a changed vLLM
contract is an `EplbContractError` (also `RuntimeError`); transfer failures reuse the common
`TransferError`/`TransferTimeout`/`IncompatiblePeer`.
"""

from __future__ import annotations

from ascend_dist.common.errors import AscendDistError, ConfigError

__all__ = ["EplbContractError", "EplbStateError", "PlacementError"]


class PlacementError(ConfigError):
    """An expert placement is malformed: an expert missing, over-replicated, out of range, or mis-shaped.

    Raised before anything moves: the old placement stays valid and in use.
    """


class EplbContractError(AscendDistError, RuntimeError):
    """The installed vLLM's EPLB classes or functions do not have the signature this adapter knows.

    Raised at install/construction time; pin a supported vLLM (``vllm>=0.33,<0.34``) or update the adapter.
    """


class EplbStateError(AscendDistError, RuntimeError):
    """An EPLB state was used before it was initialized (e.g. a routing table refresh without maps)."""
