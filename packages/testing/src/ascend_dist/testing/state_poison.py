"""A `MooncakeHybridConnector` that zeroes the recurrent state D just loaded: the engine tier's state control.

Runs in: D's worker process of ``tests/engine/test_pd_hybrid.py`` (named there by
``kv_connector_module_path``), in the engine environment. It is the real connector; only after a
request's pull is reported finished, and before D's first forward of it, it zeroes that request's
blocks of every state (Mamba / Gated DeltaNet) group, the bytes a connector that never moved the
state would have left. The attention KV is untouched, so a D output that changes proves the
transferred recurrent state, and only it, was used. Never use it outside that test.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ascend_dist.kv_mooncake.pull.vllm_connector import MooncakeConnectorV1Metadata, MooncakeHybridConnector

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext

__all__ = ["StatePoisoningHybridConnector"]

logger = logging.getLogger(__name__)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for t in value if isinstance(t, torch.Tensor)]


class StatePoisoningHybridConnector(MooncakeHybridConnector):
    """The hybrid connector, zeroing each loaded request's state blocks on D (test control only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Build the real connector; nothing is poisoned until a pull finishes."""
        super().__init__(*args, **kwargs)
        self._caches: dict[str, Any] = {}
        self._state_blocks: dict[str, list[int]] = {}
        self.poisoned = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the caches (to find the state tensors), then register them as the connector does."""
        self._caches = dict(kv_caches)
        super().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Note the state blocks of each pull this step queues, then queue them."""
        meta = self._get_connector_metadata()
        super().start_load_kv(forward_context, **kwargs)
        if isinstance(meta, MooncakeConnectorV1Metadata):
            for rid, req in meta.inner.requests.items():
                ids = {b for g in req.state_groups for b in req.local_block_ids[g] if b > 0}  # 0: vLLM's null block
                if ids and not req.notify_only:
                    self._state_blocks[rid] = sorted(ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The connector's report; each loaded request's state blocks are zeroed before vLLM sees it."""
        sending, recving = super().get_finished(finished_req_ids)
        for rid in recving or ():
            ids = self._state_blocks.pop(rid, [])
            if ids:
                self._zero(ids)
                self.poisoned += 1
                logger.warning("state control: zeroed state blocks %s of %s after its load", ids, rid)
        return sending, recving

    def _zero(self, ids: list[int]) -> None:
        index = torch.tensor(ids, dtype=torch.long)
        names = [n for g in self._state_groups for n in self._groups[g]]
        if not names:
            raise RuntimeError("state control: the model has no state group")
        for name in names:
            for t in _tensors(self._caches[name]):
                t.index_fill_(0, index.to(t.device), 0)
