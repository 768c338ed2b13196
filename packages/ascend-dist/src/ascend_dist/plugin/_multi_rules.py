"""Composition rules of the multi-connector, free of vLLM (docs/connectors.md#ascendmulticonnector).

Runs in: the scheduler process and every worker process, inside `AscendMultiConnector`.
Which child answers a load, which children get the real blocks after allocation, how finished
sets, load errors and kv_transfer_params merge, how async saves of several children are counted,
and in which order the per-layer hooks reach the children. Children are anything satisfying the
small protocols below; optional capabilities are detected per child with `isinstance` checks
against `runtime_checkable` protocols, so a child that lacks a hook is simply skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "AllocPlan",
    "Child",
    "Composition",
    "ExtraSaves",
    "KvWrittenHook",
    "MambaCopyHooks",
    "PreemptAware",
    "ReleaseWaiterSink",
    "ReuseProvider",
    "merge_finished_params",
    "merge_transfer_results",
]

Answer = tuple[int | None, bool]
"""`get_num_new_matched_tokens`'s answer: (tokens, or None = ask again later; load is async)."""


class Child(Protocol):
    """What every composed child answers (a subset of vLLM's KVConnectorBase_V1)."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Answer: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...


@runtime_checkable
class PreemptAware(Protocol):
    """A child that saves preempted requests (the recompute-offload connector)."""

    def has_preempted_request(self, req_id: str) -> bool: ...

    def update_state_before_preempt(self, request: Any, block_ids: Any, num_computed_tokens: int) -> bool: ...


@runtime_checkable
class ReuseProvider(Protocol):
    """A child whose layer storage may still be read by an in-flight send (layer-wise push on P)."""

    def wait_for_layer_reuse(self, layer_name: str) -> None: ...


@runtime_checkable
class ReleaseWaiterSink(Protocol):
    """A child that can call an external slot-release wait at layer entry (a store connector).

    Returning False declines the waiter; None or True accepts it.
    """

    def set_external_slot_release_waiter(self, waiter: Callable[[str], None]) -> bool | None: ...


@runtime_checkable
class KvWrittenHook(Protocol):
    """vllm-ascend's early per-layer hook, called right after the KV scatter."""

    def on_kv_cache_written(self, layer_name: str) -> None: ...


@runtime_checkable
class MambaCopyHooks(Protocol):
    """A child that must see Mamba state copies between blocks (it may hold those blocks)."""

    def prepare_mamba_state_copy(self, *args: Any, **kwargs: Any) -> Any: ...

    def finish_mamba_state_copy(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class AllocPlan:
    """What one child receives in `update_state_after_alloc`.

    Attributes:
        real_blocks: True: the allocated blocks; False: an empty block set.
        num_external_tokens: the token count to pass.
    """

    real_blocks: bool
    num_external_tokens: int


def merge_finished_params(
    answers: Sequence[tuple[bool, dict[str, Any] | None]],
) -> tuple[int, dict[str, Any] | None]:
    """Merge the children's `request_finished` answers (delays counted, one params dict at most).

    Args:
        answers: each child's (delay_free, kv_transfer_params), in config order.

    Returns:
        (number of children that delay freeing, the only non-None kv_transfer_params or None).

    Raises:
        RuntimeError: more than one child returned kv_transfer_params (vllm-ascend's rule; vLLM
            itself merges disjoint keys).
    """
    delaying = sum(1 for delay, _ in answers if delay)
    params = [(i, p) for i, (_, p) in enumerate(answers) if p is not None]
    if len(params) > 1:
        raise RuntimeError(
            f"children {[i for i, _ in params]} all returned kv_transfer_params; at most one child may return them"
        )
    return delaying, (params[0][1] if params else None)


@dataclass
class ExtraSaves:
    """Async saves beyond the first per request: a send is finished once every delaying child said so.

    The scheduler records the extra count when a request finishes and ships the pending counts to
    the workers in the step's metadata (`take`/`absorb`); each worker counts its children's reports.
    """

    pending: dict[str, int] = field(default_factory=dict)

    def record(self, req_id: str, delaying_children: int) -> None:
        """Scheduler side: remember `delaying_children - 1` extra reports for ``req_id``."""
        if delaying_children > 1:
            self.pending[req_id] = delaying_children - 1

    def take(self) -> dict[str, int] | None:
        """Scheduler side: the counts recorded since the last call (None when none), then forget them."""
        if not self.pending:
            return None
        out, self.pending = self.pending, {}
        return out

    def absorb(self, counts: Mapping[str, int] | None) -> None:
        """Worker side: add the counts shipped in the bound metadata."""
        if counts:
            self.pending.update(counts)

    def count(self, req_id: str) -> bool:
        """Worker side: one child reported ``req_id`` sent; True when that was the last awaited report."""
        left = self.pending.get(req_id)
        if left is None:
            return True
        if left <= 1:
            del self.pending[req_id]
        else:
            self.pending[req_id] = left - 1
        return False


def merge_transfer_results(
    per_child: Sequence[tuple[set[str], set[str], set[str]]], extra: ExtraSaves
) -> tuple[set[str], set[str], set[str]]:
    """Merge one step's (finished_sending, finished_recving, failed_recving) of every child.

    Receives and failed receives are unioned (only one child loads a request); a send counts as
    finished only after every child that delayed freeing reported it (`ExtraSaves.count`).
    """
    sending: set[str] = set()
    recving: set[str] = set()
    failed: set[str] = set()
    for child_sending, child_recving, child_failed in per_child:
        recving |= child_recving
        failed |= child_failed
        sending |= {req_id for req_id in child_sending if extra.count(req_id)}
    return sending, recving, failed


class Composition:
    """The children in config order, their traits, and the rules that dispatch to them.

    Args:
        children: the child connectors, in config order.
        reuse_providers: per child, whether it is a layer-buffer-reuse provider (a producer with a
            worker that declares `supports_layerwise_buffer_reuse` and implements
            `wait_for_layer_reuse`); the vLLM adapter decides, these rules only order by it.
        full_blocks: per child, whether it declares `requires_full_blocks_on_update_after_alloc`.
        others_get_real_blocks: whether children that neither load nor need full blocks still see
            the allocated blocks (with 0 tokens), as vLLM 0.33's MultiConnector does (its
            OffloadingConnector tracks every allocated block to detect re-allocation under pending
            stores); False: an empty block set, as vllm-ascend's override on older vLLM did.

    Raises:
        ValueError: a trait list's length differs from the number of children.
    """

    def __init__(
        self,
        children: Sequence[Child],
        reuse_providers: Sequence[bool],
        full_blocks: Sequence[bool],
        *,
        others_get_real_blocks: bool = True,
    ) -> None:
        """Validate the traits and start with no chosen loaders and no reuse sink."""
        if len(full_blocks) != len(children):
            raise ValueError(f"full_blocks ({len(full_blocks)}) must have one entry per child ({len(children)})")
        self.children = list(children)
        self.full_blocks = list(full_blocks)
        self.others_get_real_blocks = others_get_real_blocks
        self.providers: list[int] = []
        self.others: list[int] = []
        self.set_reuse_providers(reuse_providers)
        self.chosen: dict[str, int] = {}
        self.sink_configured = False

    def set_reuse_providers(self, reuse_providers: Sequence[bool]) -> None:
        """Re-mark the reuse providers (a child may only know after `register_kv_caches`).

        Raises:
            ValueError: wrong length, or a marked child has no `wait_for_layer_reuse`.
        """
        if len(reuse_providers) != len(self.children):
            raise ValueError(
                f"reuse_providers ({len(reuse_providers)}) must have one entry per child ({len(self.children)})"
            )
        for i, flag in enumerate(reuse_providers):
            if flag and not isinstance(self.children[i], ReuseProvider):
                raise ValueError(f"child {i} is marked a reuse provider but has no wait_for_layer_reuse")
        self.providers = [i for i, flag in enumerate(reuse_providers) if flag]
        self.others = [i for i, flag in enumerate(reuse_providers) if not flag]

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Answer:
        """Choose the loader for ``request`` (preempted-request holder first, then vLLM's first-match).

        A child holding the request as preempted answers first: None → ask again later; > 0 → it
        loads; 0 → fall through. Otherwise every child is asked in order (so each can track the
        request); any None stops and returns (None, False); the first child with tokens > 0 loads.
        """
        req_id: str = request.request_id
        for i, child in enumerate(self.children):
            if isinstance(child, PreemptAware) and child.has_preempted_request(req_id):
                toks, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
                if toks is None:
                    return (None, False)
                if toks > 0:
                    self.chosen[req_id] = i
                    return (toks, load_async)
        answer: Answer = (0, False)
        for i, child in enumerate(self.children):
            toks, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if toks is None:
                return (None, False)
            if answer[0] == 0 and toks > 0:
                self.chosen[req_id] = i
                answer = (toks, load_async)
        return answer

    def alloc_plan(self, req_id: str, num_external_tokens: int) -> list[AllocPlan]:
        """Per child, the blocks and token count for `update_state_after_alloc`.

        The chosen loader and children requiring full blocks get the real blocks and count; the
        others 0 tokens (they must not load) and the real blocks or an empty set, by
        `others_get_real_blocks`.
        """
        chosen = self.chosen.get(req_id, -1)
        other = AllocPlan(self.others_get_real_blocks, 0)
        return [
            AllocPlan(True, num_external_tokens) if i == chosen or self.full_blocks[i] else other
            for i in range(len(self.children))
        ]

    def update_state_before_preempt(self, request: Any, block_ids: Any, num_computed_tokens: int) -> bool:
        """Offer a preempted request to every preempt-aware child; True when any saves it."""
        saved = False
        for child in self.children:
            if isinstance(child, PreemptAware):
                saved = child.update_state_before_preempt(request, block_ids, num_computed_tokens) or saved
        return saved

    def forget(self, req_id: str) -> None:
        """The request finished: drop its chosen loader."""
        self.chosen.pop(req_id, None)

    # ---- worker side: layer-wise ordering ------------------------------------------------------

    def configure_layerwise_reuse_completion(self) -> bool:
        """Offer the slot-release waiter to every non-provider sink; True when one accepted.

        Providers are not offered their own waiter (waiting on itself at layer entry would only
        duplicate its own gate).
        """
        self.sink_configured = False
        if not self.providers:
            return False
        for i in self.others:
            child = self.children[i]
            if isinstance(child, ReleaseWaiterSink):
                accepted = child.set_external_slot_release_waiter(self.wait_for_external_slot_release)
                self.sink_configured = self.sink_configured or accepted is not False
        return self.sink_configured

    def wait_for_external_slot_release(self, layer_name: str) -> None:
        """The waiter handed to sinks: wait on every provider's reuse gate for ``layer_name``."""
        for i in self.providers:
            child = self.children[i]
            assert isinstance(child, ReuseProvider)
            child.wait_for_layer_reuse(layer_name)

    def load_order(self) -> list[int]:
        """Children called by `wait_for_layer_load`: non-providers only when a sink does the provider wait."""
        return list(self.others) if self.sink_configured else self.providers + self.others

    def save_order(self) -> list[int]:
        """Children called by `save_kv_layer` and `on_kv_cache_written`: providers first."""
        return self.providers + self.others

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Dispatch `wait_for_layer_load` in `load_order`."""
        for i in self.load_order():
            self.children[i].wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Dispatch `save_kv_layer` in `save_order` (providers close their reuse gates first)."""
        for i in self.save_order():
            self.children[i].save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def on_kv_cache_written(self, layer_name: str) -> None:
        """Dispatch `on_kv_cache_written` in `save_order` to children that have it."""
        for i in self.save_order():
            child = self.children[i]
            if isinstance(child, KvWrittenHook):
                child.on_kv_cache_written(layer_name)

    # ---- worker side: everything else ----------------------------------------------------------

    def prepare_mamba_state_copy(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Forward to every child with Mamba copy hooks, in config order; their results in that order."""
        return [c.prepare_mamba_state_copy(*args, **kwargs) for c in self.children if isinstance(c, MambaCopyHooks)]

    def finish_mamba_state_copy(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Forward to every child with Mamba copy hooks, in reverse config order (nested like a stack)."""
        hooked = [c for c in self.children if isinstance(c, MambaCopyHooks)]
        return [c.finish_mamba_state_copy(*args, **kwargs) for c in reversed(hooked)]

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The union of every child's failed block ids."""
        out: set[int] = set()
        for child in self.children:
            out |= child.get_block_ids_with_load_errors()
        return out
