"""Scheduler side of the layer-wise push: D announces its blocks first, P plans per-step pushes.

Runs in: the scheduler process of P and of D (the same class; the role decides what fires). Works
on plain values (`SchedRequest`, block-id lists); the vLLM adapter translates vLLM's objects.

Order of calls (vLLM v1): ``get_num_new_matched_tokens`` -> ``update_state_after_alloc`` ->
``build_connector_meta`` (every step) -> ``request_finished``.

* D (``do_remote_prefill``): loads ``prompt - computed`` tokens asynchronously; after allocation
  it announces **all** the request's blocks (prefix hit included) and its coordinates to the
  proxy's metaserver (`PushParams`), and the workers start waiting for the layers. A failed
  announcement fails the request (reported finished with all its blocks invalid), never the engine.
* P (``do_remote_decode``, params from the proxy): each step emits the request's block ids and its
  computed-token window; the chunk that computes the prompt's end is the last one. P frees its
  blocks at once (``request_finished`` -> ``(False, None)``); the workers' reuse gate protects
  storage still being pushed.

With a deployment secret D signs the blocks it announces (`core.capability`, valid for
``first_layer_timeout_s``) and P checks that signature once, when it first allocates for the
request, before it plans any write: params whose block ids, request id, engine id or prompt digest
differ from what D signed (or that carry none) are never pushed (logged; D's wait for them times
out and it recomputes). P does not tell D: the request id in forged params may be another client's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.kv_mooncake.core.admission import Preview, check_block_ids, check_flags, check_url
from ascend_dist.kv_mooncake.core.capability import (
    PUSH_PURPOSE,
    Capability,
    CapabilityRefused,
    check_capability,
    expiry_ms,
    sign_capability,
    wall_ms,
)
from ascend_dist.kv_mooncake.core.metaserver import AsyncAnnouncer, HttpMetaserver, Metaserver
from ascend_dist.kv_mooncake.core.ports import MAX_PORT
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.messages import PushParams, external_request_id, parse_push_params
from ascend_dist.kv_mooncake.push.step_metadata import LayerwiseMetadata, RecvReqMeta, SendReqMeta

__all__ = ["LayerwiseMetadata", "LayerwiseScheduler", "RecvReqMeta", "Scheduled", "SendReqMeta"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scheduled:
    """What P's scheduler scheduled for a request in this step.

    Attributes:
        num_computed_tokens: Tokens computed before this step.
        num_scheduled_tokens: Tokens computed in this step.
        new_block_ids: Blocks allocated in this step, per group (None: none).
    """

    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: Sequence[Sequence[int]] | None = None


@dataclass
class _Send:
    params: PushParams
    local: list[list[int]]
    prompt_len: int
    computed: int = 0
    transed: int = 0


@dataclass
class _Recv:
    computed: int = 0
    meta: RecvReqMeta | None = None
    ids: list[list[int]] = field(default_factory=list)


class LayerwiseScheduler:
    """The scheduler half of ``MooncakeLayerwiseConnector``."""

    def __init__(
        self,
        config: LayerwiseConfig,
        block_sizes: Sequence[int],
        *,
        metaserver: Metaserver | None = None,
        secret: DeploymentSecret | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Create the scheduler.

        Args:
            config: The connector configuration.
            block_sizes: Tokens per block of each KV-cache group (all equal: one block size).
            metaserver: Where D announces (default: the HTTP(S) client with the configured TLS).
            secret: The deployment secret (D signs its announcements, P checks them); None: neither.
            wall_clock: Wall seconds for the capability's expiry (injectable for tests).

        Raises:
            ConfigError: No groups, or groups with different block sizes.
        """
        if not block_sizes or any(b <= 0 for b in block_sizes) or len(set(block_sizes)) != 1:
            raise ConfigError("block_sizes", list(block_sizes), "one positive, equal block size per KV-cache group")
        self._config = config
        self._secret = secret
        self._wall_clock = wall_clock
        self._block_sizes = list(block_sizes)
        self._block = block_sizes[0]
        self._recv: dict[str, _Recv] = {}
        self._send: dict[str, _Send] = {}
        self._lock = threading.Lock()
        self._failed: dict[str, str] = {}
        self._ended: list[str] = []  # P: pushes that ended before their last chunk, for the next step
        self._announcer: AsyncAnnouncer | None = None
        if not config.is_producer:
            client = metaserver or HttpMetaserver(config.tls, timeout_s=config.metaserver_timeout_s)
            self._announcer = AsyncAnnouncer(client, self._announce_failed)

    @property
    def tracked(self) -> int:
        """Requests with scheduler state (0 when idle: nothing leaks)."""
        with self._lock:
            return len(self._recv) + len(self._send) + len(self._failed) + len(self._ended)

    def check_params(self, request_id: str, raw: Mapping[str, Any], prompt_len: int) -> PushParams | None:
        """The strict check the vLLM adapter's `ParamsGate` runs before any hook sees a request's params.

        D (``do_remote_prefill``) needs an http(s) ``metaserver`` URL (https with ``ssl_enable``); P
        (``do_remote_decode``) needs D's announcement (`parse_push_params`) with D's TP/PCP/DCP sizes
        as configured under ``decode``, a base port that fits D's ports and one block list per group
        of no more blocks than the prompt needs. Each flag only on its role. Pure.

        Returns:
            P's parsed push params, or None when the request asks for no push.

        Raises:
            ConfigError: Names ``kv_transfer_params.<key>``.
        """
        if not isinstance(raw, Mapping):
            raise ConfigError("kv_transfer_params", Preview(raw), "a dict")
        check_flags(raw)
        producer = self._config.is_producer
        if raw.get("do_remote_prefill"):
            if producer:
                raise ConfigError("kv_transfer_params.do_remote_prefill", True, "false on P (kv_producer)")
            url = check_url("metaserver", raw.get("metaserver"), self._config.metaserver_hosts)
            if self._config.tls.ssl_enable and not url.startswith("https://"):
                raise ConfigError("kv_transfer_params.metaserver", Preview(url), "https:// (tls_config.ssl_enable)")
        if not raw.get("do_remote_decode"):
            return None
        if not producer:
            raise ConfigError("kv_transfer_params.do_remote_decode", True, "false on D (kv_consumer)")
        return self._check_push(request_id, raw, prompt_len)

    def _check_push(self, request_id: str, raw: Mapping[str, Any], prompt_len: int) -> PushParams:
        params = parse_push_params({"request_id": request_id, **raw})
        d = self._config.decode
        for key, got, want in (
            ("tp_size", params.remote_tp_size, d.tp_size),
            ("pcp_size", params.remote_pcp_size, d.pcp_size),
            ("dcp_size", params.remote_dcp_size, d.dcp_size),
        ):
            if got != want:
                raise ConfigError(f"kv_transfer_params.remote_{key}", got, f"decode.{key}={want}")
        if params.remote_port + d.tp_size * d.pcp_size - 1 > MAX_PORT:
            raise ConfigError("kv_transfer_params.remote_port", params.remote_port, "a base with D's ports <= 65535")
        if params.remote_cached_tokens > prompt_len:
            raise ConfigError("kv_transfer_params.remote_cached_tokens", params.remote_cached_tokens, "<= the prompt")
        per_group = math.ceil(max(prompt_len, 1) / self._block) + 2
        check_block_ids("remote_block_ids", params.remote_block_ids, len(self._block_sizes), per_group)
        return params

    def get_num_new_matched_tokens(self, request: SchedRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """D: tokens P pushes beyond D's prefix hit (async); P: none.

        Raises:
            ConfigError: ``num_computed_tokens`` is not whole blocks.
        """
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        if num_computed_tokens % self._block:
            raise ConfigError("num_computed_tokens", num_computed_tokens, f"a multiple of block_size={self._block}")
        count = max(request.prompt_len - num_computed_tokens, 0)
        return count, count > 0  # a pure query: `update_state_after_alloc` records the request

    def update_state_after_alloc(
        self, request: SchedRequest, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """D: announce all the request's blocks; P: start tracking a push request.

        Args:
            request: The request.
            block_ids: Per group, ALL of the request's blocks (prefix hit included).
            num_external_tokens: What `get_num_new_matched_tokens` promised.

        Raises:
            ConfigError: Bad ``kv_transfer_params`` (names the key) or group count.
        """
        raw = request.kv_transfer_params
        if not raw:
            return
        if len(block_ids) != len(self._block_sizes):
            raise ConfigError("block_ids", len(block_ids), f"{len(self._block_sizes)} lists (one per KV-cache group)")
        if raw.get("do_remote_prefill") and not self._config.is_producer:
            raw["do_remote_prefill"] = False
            if num_external_tokens > 0:
                # vLLM passes back what the query answered (prompt - prefix hit), so the hit is recovered here.
                computed = max(request.prompt_len - num_external_tokens, 0)
                self._announce(request, [list(ids) for ids in block_ids], raw, computed)
            return
        if raw.get("do_remote_decode") and self._config.is_producer:
            if "remote_block_ids" not in raw:
                logger.warning(
                    "request %s: do_remote_decode without D's announcement (remote_block_ids); nothing is pushed",
                    request.request_id,
                )
                return
            params = parse_push_params({"request_id": request.request_id, **raw})
            if request.request_id not in self._send:
                if not self._signed(params):
                    return
                self._send[request.request_id] = _Send(
                    params, [list(ids) for ids in block_ids], request.prompt_len, transed=params.remote_cached_tokens
                )
            else:
                self._send[request.request_id].local = [list(ids) for ids in block_ids]

    def _announce(self, request: SchedRequest, ids: list[list[int]], raw: Mapping[str, object], computed: int) -> None:
        rid = request.request_id
        state = self._recv.setdefault(rid, _Recv())
        state.computed = computed
        c = self._config
        wire_id = external_request_id(rid)  # what the proxy and P know this request by
        payload = PushParams(
            request_id=wire_id,
            remote_engine_id=c.engine_id,
            remote_host=c.host,
            remote_port=c.d_ports.dp_base(c.dp_rank),
            remote_block_ids=ids,
            remote_block_size=list(self._block_sizes),
            remote_tp_size=c.decode.tp_size,
            remote_pcp_size=c.decode.pcp_size,
            remote_dcp_size=c.decode.dcp_size,
            remote_cached_tokens=state.computed,
            remote_prompt_tokens=request.prompt_len if request.prompt_digest is not None else None,
            remote_prompt_digest=request.prompt_digest,
        )
        payload = self._sign(payload)
        state.meta = RecvReqMeta(request_id=rid, transfer_id=wire_id, block_ids=ids)
        state.ids = ids
        url = raw.get("metaserver")
        if not isinstance(url, str) or not url:
            self._announce_failed(rid, "kv_transfer_params.metaserver is missing (the proxy's /v1/metaserver URL)")
            return
        assert self._announcer is not None
        self._announcer.announce(rid, url, msgspec.to_builtins(payload))

    def _capability(self, params: PushParams, expires_ms: int) -> Capability:
        return Capability(
            params.request_id,
            params.remote_engine_id,
            [list(ids) for ids in params.remote_block_ids],
            params.remote_prompt_digest or "",
            expires_ms,
        )

    def _sign(self, payload: PushParams) -> PushParams:
        """D's announcement with its capability (unchanged without a secret)."""
        if self._secret is None:
            return payload
        expires = expiry_ms(self._config.first_layer_timeout_s, self._wall_clock)
        tag = sign_capability(self._secret, PUSH_PURPOSE, self._capability(payload, expires))
        return msgspec.structs.replace(payload, remote_capability=tag, remote_capability_expires=expires)

    def _signed(self, params: PushParams) -> bool:
        """P: whether D signed exactly these params (always, without a secret); logged when not."""
        if self._secret is None:
            return True
        try:
            check_capability(
                self._secret,
                PUSH_PURPOSE,
                self._capability(params, params.remote_capability_expires or 0),
                params.remote_capability,
                field="kv_transfer_params.remote_capability",
                now_ms=wall_ms(self._wall_clock),
            )
        except CapabilityRefused as exc:
            logger.error("request %s: not pushing to D: %s", params.request_id[:128], exc)
            return False
        return True

    def _announce_failed(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._failed[request_id] = reason

    def build_connector_meta(self, scheduled: Mapping[str, Scheduled] | None = None) -> LayerwiseMetadata:
        """This step's work: D's new waits (and failed announcements), P's pushes.

        Args:
            scheduled: P: what was scheduled per request id in this step.
        """
        recv: list[RecvReqMeta] = []
        for state in self._recv.values():
            if state.meta is not None:
                recv.append(state.meta)
                state.meta = None
        with self._lock:
            failed, self._failed = self._failed, {}
        for rid, reason in failed.items():
            state = self._recv.get(rid)
            if state is None:  # finished (aborted) meanwhile: nothing left to report
                continue
            recv.append(
                RecvReqMeta(request_id=rid, transfer_id=external_request_id(rid), block_ids=state.ids, failed=reason)
            )
        ended, self._ended = self._ended, []
        return LayerwiseMetadata(recv=recv, send=self._sends(scheduled or {}), ended=ended)

    def _sends(self, scheduled: Mapping[str, Scheduled]) -> list[SendReqMeta]:
        out: list[SendReqMeta] = []
        for rid, step in scheduled.items():
            info = self._send.get(rid)
            if info is None:
                continue
            for ids, new in zip(info.local, step.new_block_ids or [], strict=False):
                known = set(ids)
                ids.extend(x for x in new if x not in known)
            info.transed = max(info.transed, (info.computed // self._block) * self._block)
            info.computed = step.num_computed_tokens + step.num_scheduled_tokens
            finished = info.computed >= info.prompt_len
            out.append(
                SendReqMeta(
                    request_id=rid,
                    params=info.params,
                    local_block_ids=[list(x) for x in info.local],
                    prompt_len=info.prompt_len,
                    transed_tokens=info.transed,
                    computed_tokens=min(info.computed, info.prompt_len),
                    chunk_finished=finished,
                )
            )
            if finished:
                del self._send[rid]
        return out

    def request_finished(self, request: SchedRequest, block_ids: Sequence[Sequence[int]]) -> tuple[bool, None]:
        """Forget the request; blocks are freed at once on both sides (P: the reuse gate protects them).

        P: a push that ends before its last chunk (the client aborted, a stop) is handed to the
        workers at the next step (`LayerwiseMetadata.ended`): each rank that wrote some of it tells
        D it failed once its written layers are notified, so D reports it at once instead of after
        ``layer_timeout_s`` and the fence's ``fence_timeout_s`` (D cannot tell such a P from a dead one).
        """
        self._recv.pop(request.request_id, None)
        info = self._send.pop(request.request_id, None)
        if info is not None and info.computed > 0:  # some chunk was scheduled: the workers wrote part of it
            self._ended.append(info.params.request_id)
        return False, None

    def close(self) -> None:
        """Stop the announcement threads (D). Idempotent."""
        if self._announcer is not None:
            self._announcer.close()
