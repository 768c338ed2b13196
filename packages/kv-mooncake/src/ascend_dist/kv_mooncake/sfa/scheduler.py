"""Scheduler side of the SFA remote-D2H connector: the consumer (D) and producer (P) halves.

Runs in: vLLM's scheduler process. Call order per request:

* D: `ConsumerScheduler.get_num_new_matched_tokens` -> ``update_state_after_alloc`` (records the
  destination block ids, posts D's contact info to the metaserver) -> ``build_connector_meta``
  (hands the destinations to D's workers) -> ``request_finished`` (drops the request, cancels a
  pending metaserver post; vLLM keeps ownership of the blocks).
* P: `ProducerScheduler.update_state_after_alloc` (D's contact info arrived in
  ``kv_transfer_params``) -> ``build_connector_meta`` each step (the chunk's computed tokens and
  every block allocated so far) -> ``request_finished`` (P frees its blocks at once: its workers'
  reuse gates hold the next writer of a layer until D's read of it finished).

Both halves only translate; the metadata they build is frozen and never mutated afterwards.

With a deployment secret D signs the contact it posts (`core.capability`: D's external id, engine
id and an expiry; ``remote_capability``) and P tracks only contacts D signed, so an API client of P
cannot point P's reads at another client's D request (P's reads would land in that request's
blocks). An unsigned or altered contact is logged and never offered to D.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.kv_mooncake.core.admission import Preview, check_flags, check_url
from ascend_dist.kv_mooncake.core.capability import (
    SFA_PURPOSE,
    Capability,
    CapabilityRefused,
    check_capability,
    expiry_ms,
    sign_capability,
    wall_ms,
)
from ascend_dist.kv_mooncake.core.ports import MAX_PORT
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.messages import ContactInfo, parse_contact
from ascend_dist.kv_mooncake.sfa.plan import GroupIds
from ascend_dist.kv_mooncake.sfa.step_metadata import ConsumerMetadata, ProducerMetadata, RecvReq, SendReq

__all__ = [
    "ConsumerMetadata",
    "ConsumerScheduler",
    "ContactSink",
    "ProducerMetadata",
    "ProducerScheduler",
    "RecvReq",
    "SendReq",
    "SfaRequest",
    "StepRequest",
    "contact_capability",
]

logger = logging.getLogger(__name__)


def contact_capability(contact: ContactInfo, expires_ms: int) -> Capability:
    """What D signs of its contact: its external id and engine id (no block ids: P never names D's)."""
    return Capability(contact.request_id, contact.remote_engine_id, [], "", expires_ms)


def _check_role(raw: object, *, refused: str, role: str) -> None:
    """``raw`` is a dict whose flags are booleans and whose ``refused`` flag is not set on this role."""
    if not isinstance(raw, Mapping):
        raise ConfigError("kv_transfer_params", Preview(raw), "a dict")
    check_flags(raw)
    if raw.get(refused):
        raise ConfigError(f"kv_transfer_params.{refused}", True, f"false on {role}")


class ContactSink(Protocol):
    """Where D's scheduler sends its contact info for P (the proxy's metaserver)."""

    def post(self, ext_id: str, contact: ContactInfo, url: str | None = None) -> None:
        """Deliver (possibly asynchronously, with retries) D's contact info to ``url``."""
        ...

    def cancel(self, ext_id: str) -> None:
        """Stop retrying a request's post (it finished)."""
        ...


@dataclass
class SfaRequest:
    """What the scheduler hooks read from a vLLM request.

    Attributes:
        request_id: vLLM's request id.
        ext_id: The id both instances know (the proxy's id; the wire uses it).
        prompt_len: Prompt tokens.
        kv_transfer_params: The request's params (updated in place as vLLM does).
    """

    request_id: str
    ext_id: str
    prompt_len: int
    kv_transfer_params: dict[str, Any] | None = None


class ConsumerScheduler:
    """D's scheduler half."""

    def __init__(
        self,
        config: SfaConfig,
        block_sizes: Sequence[int],
        groups: GroupIds,
        sink: ContactSink,
        *,
        secret: DeploymentSecret | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Create the scheduler.

        Args:
            config: The connector configuration (role consumer).
            block_sizes: Block size of every vLLM KV-cache group.
            groups: Which groups hold the main and the indexer caches.
            sink: Where the contact info goes.
            secret: The deployment secret: D signs its contact (valid ``recv_timeout_s``); None: unsigned.
            wall_clock: Wall seconds for the capability's expiry (injectable for tests).
        """
        self._config = config
        self._secret = secret
        self._wall_clock = wall_clock
        self._block_sizes = list(block_sizes)
        self._groups = groups
        self._sink = sink
        self._queued: list[RecvReq] = []
        self._active: set[str] = set()

    @property
    def tracked(self) -> int:
        """Requests waiting for P (allocated, not finished)."""
        return len(self._active)

    def check_params(self, ext_id: str, raw: Mapping[str, Any], prompt_len: int) -> None:
        """The strict check the vLLM adapter's `ParamsGate` runs before any hook sees a request's params.

        ``do_remote_decode`` is refused (D never prefills for another instance); ``do_remote_prefill``
        needs an http(s) ``metaserver`` URL unless ``do_virtual``. Pure.

        Raises:
            ConfigError: Names ``kv_transfer_params.<key>``.
        """
        _check_role(raw, refused="do_remote_decode", role="D (kv_consumer)")
        if raw.get("do_remote_prefill") and not raw.get("do_virtual"):
            check_url("metaserver", raw.get("metaserver"), self._config.metaserver_hosts)

    def get_num_new_matched_tokens(self, request: SfaRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """``(prompt_len - computed, True)`` for a remote-prefill request, else ``(0, False)``.

        Raises:
            ConfigError: ``num_computed_tokens`` is not block aligned.
        """
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        block = min(self._block_sizes)
        if num_computed_tokens % block:
            raise ConfigError("num_computed_tokens", num_computed_tokens, f"a multiple of the block size {block}")
        count = max(request.prompt_len - num_computed_tokens, 0)
        return count, count > 0

    def update_state_after_alloc(
        self, request: SfaRequest, block_ids: Sequence[Sequence[int]], num_external_tokens: int, num_computed: int
    ) -> ContactInfo | None:
        """Record the destinations and post D's contact info; returns what was posted.

        Args:
            request: The request.
            block_ids: ALL its block ids per group (prefix-hit blocks included).
            num_external_tokens: Tokens promised by `get_num_new_matched_tokens` (0: nothing).
            num_computed: Tokens D already holds (P starts after them).
        """
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        params["do_remote_prefill"] = False
        if num_external_tokens <= 0:
            return None
        if len(block_ids) <= max(self._groups.main, self._groups.indexer):
            raise ConfigError("block_ids", f"<{len(block_ids)} groups>", "one list per KV-cache group")
        req = RecvReq(
            request.request_id,
            request.ext_id,
            tuple(block_ids[self._groups.main]),
            tuple(block_ids[self._groups.indexer]) if self._groups.indexer != self._groups.main else (),
        )
        self._queued.append(req)
        self._active.add(request.request_id)
        c = self._config
        contact = ContactInfo(
            request_id=request.ext_id,
            remote_engine_id=c.engine_id,
            remote_host=c.host,
            remote_port=c.d_base_port,
            remote_tp_size=c.decode.tp_size,
            remote_cached_tokens=num_computed,
        )
        if self._secret is not None:
            expires = expiry_ms(c.recv_timeout_s, self._wall_clock)
            tag = sign_capability(self._secret, SFA_PURPOSE, contact_capability(contact, expires))
            contact = msgspec.structs.replace(contact, remote_capability=tag, remote_capability_expires=expires)
        if not params.get("do_virtual"):
            url = params.get("metaserver")
            self._sink.post(request.ext_id, contact, url if isinstance(url, str) else None)
        return contact

    def build_connector_meta(self) -> ConsumerMetadata:
        """This step's new requests; resets the queue."""
        out, self._queued = ConsumerMetadata(tuple(self._queued)), []
        return out

    def request_finished(self, request: SfaRequest) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request and stop its metaserver post; vLLM frees the blocks."""
        self._active.discard(request.request_id)
        self._queued = [r for r in self._queued if r.request_id != request.request_id]
        self._sink.cancel(request.ext_id)
        return False, None


@dataclass(frozen=True)
class StepRequest:
    """What P's scheduler needs of one scheduled request (translated from ``SchedulerOutput``).

    ``block_ids`` are the request's new blocks per group (all of them when ``is_new``).
    """

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: tuple[tuple[int, ...], ...] = ()
    is_new: bool = False


@dataclass
class _Send:
    contact: ContactInfo
    prompt_len: int
    main: list[int] = field(default_factory=list)
    indexer: list[int] = field(default_factory=list)
    computed: int = 0


class ProducerScheduler:
    """P's scheduler half."""

    def __init__(
        self,
        config: SfaConfig,
        block_sizes: Sequence[int],
        groups: GroupIds,
        *,
        secret: DeploymentSecret | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Create the scheduler (``block_sizes``: one per vLLM KV-cache group).

        ``secret``: the deployment secret: P tracks (and so reads are offered for) only contacts D
        signed; None: every well-formed contact, as upstream.
        """
        self._config = config
        self._secret = secret
        self._wall_clock = wall_clock
        self._block = min(block_sizes)
        self._groups = groups
        self._sends: dict[str, _Send] = {}

    @property
    def tracked(self) -> int:
        """Requests still being prefilled for a D."""
        return len(self._sends)

    def get_num_new_matched_tokens(self, request: SfaRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """P never loads anything."""
        return 0, False

    def _contact(self, ext_id: str, params: Mapping[str, Any]) -> ContactInfo:
        batch = params.get("batch_kv_transfer_params")
        if batch is not None:
            if not isinstance(batch, Mapping) or ext_id not in batch:
                raise ConfigError(
                    f"kv_transfer_params.batch_kv_transfer_params[{Preview(ext_id)}]", None, "an entry per child"
                )
            params = batch[ext_id]
        return parse_contact(params)

    def check_params(self, ext_id: str, raw: Mapping[str, Any], prompt_len: int) -> ContactInfo | None:
        """The strict check the vLLM adapter's `ParamsGate` runs before any hook sees a request's params.

        ``do_remote_prefill`` is refused (P never loads); ``do_remote_decode`` needs D's contact info
        (`parse_contact`, or this child's entry of ``batch_kv_transfer_params``) with D's TP size as
        configured under ``decode``, a base port that fits D's ranks and at most the prompt cached. Pure.

        Returns:
            D's contact info, or None when the request asks for no transfer.

        Raises:
            ConfigError: Names ``kv_transfer_params.<key>``.
        """
        _check_role(raw, refused="do_remote_prefill", role="P (kv_producer)")
        if not raw.get("do_remote_decode"):
            return None
        contact = self._contact(ext_id, raw)
        d_tp = self._config.decode.tp_size
        if contact.remote_tp_size != d_tp:
            raise ConfigError("kv_transfer_params.remote_tp_size", contact.remote_tp_size, f"decode.tp_size={d_tp}")
        if contact.remote_port + d_tp - 1 > MAX_PORT:
            raise ConfigError("kv_transfer_params.remote_port", contact.remote_port, "a base with D's ports <= 65535")
        if contact.remote_cached_tokens > prompt_len:
            raise ConfigError("kv_transfer_params.remote_cached_tokens", contact.remote_cached_tokens, "<= the prompt")
        return contact

    def update_state_after_alloc(self, request: SfaRequest) -> None:
        """Start tracking a request whose params carry D's contact info (``do_remote_decode``).

        Raises:
            ConfigError: The contact info is malformed; the error names the key.
        """
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or request.request_id in self._sends:
            return
        contact = self._contact(request.ext_id, params)
        if self._secret is not None:
            try:
                check_capability(
                    self._secret,
                    SFA_PURPOSE,
                    contact_capability(contact, contact.remote_capability_expires or 0),
                    contact.remote_capability,
                    field="kv_transfer_params.remote_capability",
                    now_ms=wall_ms(self._wall_clock),
                )
            except CapabilityRefused as exc:
                # D is not told: the id in an unsigned contact may be another client's request.
                logger.error("request %s: no reads offered to D: %s", request.request_id[:128], exc)
                return
        self._sends[request.request_id] = _Send(contact, request.prompt_len)

    def build_connector_meta(self, steps: Sequence[StepRequest]) -> ProducerMetadata:
        """This step's chunks; forgets requests whose prompt completes in this step."""
        out: list[SendReq] = []
        for step in steps:
            send = self._sends.get(step.request_id)
            if send is None:
                continue
            if step.block_ids:
                main = list(step.block_ids[self._groups.main])
                idx = list(step.block_ids[self._groups.indexer]) if self._groups.indexer != self._groups.main else []
                send.main = main if step.is_new else send.main + main
                send.indexer = idx if step.is_new else send.indexer + idx
            transferred = send.computed // self._block * self._block
            send.computed = min(send.prompt_len, step.num_computed_tokens + step.num_scheduled_tokens)
            finish = send.computed >= send.prompt_len
            c = send.contact
            out.append(
                SendReq(
                    c.request_id,
                    tuple(send.main),
                    tuple(send.indexer),
                    c.remote_host,
                    c.remote_port,
                    c.remote_tp_size,
                    c.remote_cached_tokens,
                    transferred,
                    send.computed,
                    finish,
                    d_engine_id=c.remote_engine_id,
                )
            )
            if finish:
                del self._sends[step.request_id]
        return ProducerMetadata(tuple(out))

    def request_finished(self, request: SfaRequest) -> tuple[bool, dict[str, Any] | None]:
        """Drop the tracker; P's blocks are freed at once (the reuse gates protect them)."""
        self._sends.pop(request.request_id, None)
        return False, None
