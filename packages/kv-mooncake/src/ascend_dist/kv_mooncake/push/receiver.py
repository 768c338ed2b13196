"""D's bookkeeping of pushed layers: which layers of which request arrived from how many senders.

Runs in: D worker processes, fed by the side-channel server thread (`LayerDone`, `PushDone`) and the
model-runner thread (`expect`, `take_finished`, `wait_layer`). Owns no thread.

A request is *received* once ``trans_count`` distinct P senders sent ``PushDone(ok=True)``; a layer of it
has arrived once ``trans_count`` senders reported it. A request *fails* when a sender reports a
failure, when its announcement failed, or when its next layer does not arrive in time
(``first_layer_timeout_s`` after the announcement, then ``layer_timeout_s`` after each layer): it
is then reported in ``finished_recving`` together with every one of its blocks as a load error
(upstream left it in ``WAITING_FOR_REMOTE_KVS`` forever). vLLM recomputes a failed request into
the same blocks, so the report is fenced: a request some P sender claimed (`Claim`, sent before
that sender's first write of each step) is held (``FENCING``) until each claimant sent its
`PushDone`, bounded by ``fence_timeout_s``; claims arriving after D gave up are answered
``unknown`` and P writes nothing. Messages for a failed request are answered
``unknown`` so P stops pushing it; messages that arrive before the request is expected are kept
(bounded, for ``first_layer_timeout_s``).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.common.states import StateTable
from ascend_dist.kv_mooncake.push.messages import LayerDone, PushDone
from ascend_dist.kv_mooncake.push.step_metadata import RecvReqMeta

__all__ = ["LayerReceiver", "RecvState"]

logger = logging.getLogger(__name__)

_MAX_EARLY = 4096
_MAX_TOMBSTONES = 16384


class RecvState(enum.Enum):
    """A pushed request on one D worker."""

    EARLY = enum.auto()  # P's messages arrived before the step that announced it reached this worker
    WAITING = enum.auto()  # expected, no layer yet (deadline: first_layer_timeout_s)
    RECEIVING = enum.auto()  # layers arriving (deadline: layer_timeout_s after the last one)
    FENCING = enum.auto()  # failed; held until every claimant's PushDone (its writes ended) or fence_timeout_s
    DONE = enum.auto()  # every sender finished: reported in finished_recving
    FAILED = enum.auto()  # reported in finished_recving with all its blocks as load errors


RECV_TRANSITIONS: Final = {
    RecvState.EARLY: frozenset({RecvState.WAITING, RecvState.RECEIVING, RecvState.FENCING, RecvState.FAILED}),
    RecvState.WAITING: frozenset({RecvState.RECEIVING, RecvState.DONE, RecvState.FENCING, RecvState.FAILED}),
    RecvState.RECEIVING: frozenset({RecvState.DONE, RecvState.FENCING, RecvState.FAILED}),
    RecvState.FENCING: frozenset({RecvState.FAILED}),
    RecvState.DONE: frozenset(),
    RecvState.FAILED: frozenset(),
}


@dataclass
class _Req:
    request_id: str = ""
    block_ids: list[list[int]] = field(default_factory=list)
    since: float = 0.0
    trans_count: int = 0
    layers: dict[int, set[str]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    layers_complete: int = 0
    claimed: set[str] = field(default_factory=set)  # senders that announced writes (Claim)
    ended: set[str] = field(default_factory=set)  # senders whose PushDone (ok or not) arrived: no more writes
    reason: str = ""  # why it failed (FENCING)
    fence_until: float = 0.0


class LayerReceiver:
    """Per-request layer arrivals, completion and deadlines of one D worker."""

    def __init__(
        self,
        num_layers: int,
        *,
        first_layer_timeout_s: float,
        layer_timeout_s: float,
        fence_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create an empty receiver; ``clock`` is injectable for tests."""
        self._num_layers = num_layers
        self._fence_s = fence_timeout_s
        self._first_s = first_layer_timeout_s
        self._layer_s = layer_timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._reqs: dict[str, _Req] = {}
        self._states: StateTable[RecvState] = StateTable(RECV_TRANSITIONS, name="lw-recv")
        self._done: list[str] = []
        self._failed: dict[str, tuple[str, list[list[int]]]] = {}
        self._tombstones: OrderedDict[str, str] = OrderedDict()  # failed ids -> reason not yet reported

    @property
    def pending(self) -> int:
        """Requests still waited for (0 when idle)."""
        with self._cond:
            return sum(1 for t in self._reqs if self._states.state(t) is not RecvState.EARLY)

    def __len__(self) -> int:
        with self._cond:
            return len(self._reqs) + len(self._done) + len(self._failed)

    def expect(self, meta: RecvReqMeta) -> None:
        """Start waiting for a request (or fail it now when ``meta.failed`` is set)."""
        with self._cond:
            tid = meta.transfer_id
            req = self._reqs.get(tid)
            if req is None:
                if tid in self._tombstones:  # already failed (e.g. its announcement)
                    unreported = self._tombstones[tid]
                    if unreported:  # failed before this worker knew the request: vLLM must still hear it
                        self._tombstones[tid] = ""
                        self._failed[meta.request_id] = (unreported, meta.block_ids)
                    return
                req = self._reqs[tid] = _Req()
                self._states.add(tid, RecvState.WAITING)
            elif self._states.state(tid) is RecvState.FENCING:  # reported when the fence is released
                req.request_id, req.block_ids = meta.request_id, meta.block_ids or req.block_ids
                return
            elif self._states.state(tid) is RecvState.EARLY:
                self._states.advance(tid, RecvState.RECEIVING if req.layers else RecvState.WAITING)
            req.request_id, req.block_ids = meta.request_id, meta.block_ids or req.block_ids
            if meta.failed:
                self._fail(tid, meta.failed)
                return
            req.since = self._clock()
            self._check_complete(tid, req)

    def _entry(self, transfer_id: str) -> _Req | None:
        """The request's state, creating an early entry; None for a failed (tombstoned) one."""
        if transfer_id in self._tombstones:
            return None
        req = self._reqs.get(transfer_id)
        if req is None:
            if len(self._reqs) >= _MAX_EARLY + self.pending:
                logger.warning("too many unknown requests pushed to this D worker; dropping %s", transfer_id)
                return None
            req = self._reqs[transfer_id] = _Req(since=self._clock())
            self._states.add(transfer_id, RecvState.EARLY)
        return req

    def on_claim(self, sender: str, request_ids: Collection[str]) -> list[str]:
        """``sender`` is about to write these requests: record it; return the ids it must not write."""
        unknown: list[str] = []
        with self._cond:
            for tid in request_ids:
                req = self._entry(tid)
                if req is None or self._states.state(tid) is RecvState.FENCING:
                    unknown.append(tid)
                    continue
                req.claimed.add(sender)
        return unknown

    def on_layer_done(self, msg: LayerDone) -> list[str]:
        """Record a layer of several requests from one sender; return the ids D does not wait for."""
        unknown: list[str] = []
        with self._cond:
            for tid in msg.request_ids:
                req = self._entry(tid)
                if req is None or self._states.state(tid) is RecvState.FENCING:
                    unknown.append(tid)
                    continue
                req.trans_count = max(req.trans_count, msg.trans_count)
                if self._states.state(tid) is RecvState.WAITING:
                    self._states.advance(tid, RecvState.RECEIVING)
                for layer in msg.layers:
                    senders = req.layers.setdefault(layer, set())
                    if msg.sender in senders:  # a repeated report (retried RPC) is no new arrival
                        continue
                    senders.add(msg.sender)
                    if len(senders) == req.trans_count:
                        req.layers_complete += 1
                req.since = self._clock()
            self._cond.notify_all()
        return unknown

    def on_done(self, msg: PushDone) -> bool:
        """Record one sender's end of a request; return whether D still waited for it."""
        with self._cond:
            req = self._entry(msg.request_id)
            if req is None:
                return False
            req.ended.add(msg.sender)
            if self._states.state(msg.request_id) is RecvState.FENCING:
                self._release_fence(msg.request_id, req)
                return False
            if not msg.ok:
                self._fail(msg.request_id, f"P {msg.sender} reported failure: {msg.reason or 'no reason'}")
                return True
            req.trans_count = max(req.trans_count, msg.trans_count)
            req.done.add(msg.sender)
            self._check_complete(msg.request_id, req)
            return True

    def _check_complete(self, tid: str, req: _Req) -> None:
        live = self._states.state(tid) in (RecvState.WAITING, RecvState.RECEIVING)
        if live and req.trans_count and len(req.done) >= req.trans_count:
            del self._reqs[tid]
            self._states.advance(tid, RecvState.DONE)
            self._states.pop(tid)
            self._done.append(req.request_id)
            self._cond.notify_all()

    def _fail(self, tid: str, reason: str) -> None:
        req = self._reqs[tid]
        if req.claimed - req.ended and self._states.state(tid) is not RecvState.FENCING:
            # A claimant may still write: vLLM must not recompute into the blocks before its PushDone.
            self._states.advance(tid, RecvState.FENCING)
            req.reason, req.fence_until = reason, self._clock() + self._fence_s
            self._cond.notify_all()
            return
        self._finish_failed(tid, reason)

    def _release_fence(self, tid: str, req: _Req) -> None:
        if not req.claimed - req.ended:
            self._finish_failed(tid, req.reason)

    def _finish_failed(self, tid: str, reason: str) -> None:
        req = self._reqs.pop(tid)
        self._states.advance(tid, RecvState.FAILED)
        self._states.pop(tid)
        if req.request_id:
            logger.error(
                "request %s failed: %s; its %d blocks are reported as load errors",
                tid,
                reason,
                sum(len(x) for x in req.block_ids),
            )
            self._failed[req.request_id] = (reason, req.block_ids)
        self._tombstones[tid] = "" if req.request_id else reason  # reason: still to report at `expect`
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)
        self._cond.notify_all()

    def _expire(self) -> None:
        now = self._clock()
        for tid, req in list(self._reqs.items()):
            state = self._states.state(tid)
            if state is RecvState.EARLY:
                if now - req.since > self._first_s:  # pushed to us but never announced here
                    del self._reqs[tid]
                    self._states.pop(tid)
                continue
            if state is RecvState.FENCING:
                if now > req.fence_until:
                    left = sorted(req.claimed - req.ended)
                    logger.error(
                        "request %s: P sender(s) %s never ended after D gave up; reporting it after %.1f s anyway "
                        "(a write still in flight from them could land in the recomputed blocks)",
                        tid,
                        left[:4],
                        self._fence_s,
                    )
                    self._finish_failed(tid, req.reason)
                continue
            limit = self._layer_s if state is RecvState.RECEIVING else self._first_s
            if now - req.since > limit:
                nxt = req.layers_complete
                self._fail(tid, f"layer {nxt} did not arrive within {limit:.1f} s")

    def take_finished(self) -> tuple[set[str], set[int], dict[str, str]]:
        """Requests finished since the last call: ``(ids, failed block ids, failure reasons)``.

        Failed requests are in ``ids`` too (vLLM must see them finish), with all their blocks in the
        second set, reported in the same call.
        """
        with self._cond:
            self._expire()
            done = set(self._done)
            self._done.clear()
            errors: set[int] = set()
            reasons: dict[str, str] = {}
            for rid, (reason, ids) in self._failed.items():
                done.add(rid)
                errors.update(b for group in ids for b in group)
                reasons[rid] = reason
            self._failed.clear()
            return done, errors, reasons

    def wait_layer(self, layer: int, transfer_ids: Collection[str], timeout_s: float) -> None:
        """Block until ``layer`` of each listed request arrived (or the request finished or failed).

        Raises:
            DeadlineExceeded: Some request's layer did not arrive within ``timeout_s``.
        """
        deadline = self._clock() + timeout_s

        def missing() -> list[str]:
            return [
                t
                for t in transfer_ids
                if (r := self._reqs.get(t)) is not None
                and self._states.state(t) in (RecvState.WAITING, RecvState.RECEIVING)
                and len(r.layers.get(layer, ())) < max(r.trans_count, 1)
            ]

        with self._cond:
            while left := missing():
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise DeadlineExceeded(f"layer {layer} of {left[:4]} did not arrive within {timeout_s} s")
                self._cond.wait(min(remaining, 0.05))
