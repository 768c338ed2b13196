"""D's side-channel client to P workers: handshake and metadata cache, lease checks, DONEs (batched).

Runs in: D worker processes (the receiver's pool threads; thread-safe). Every request has the
deadline and retries of `ascend_dist.common.zmq_rpc.RpcClient`; replies are decoded strictly. A P
worker's metadata is fetched once after a compatibility handshake and cached per (engine id,
host, port) until a transfer from it fails (`forget`): a P restarted on the same port must not be
read with stale addresses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import NamedTuple

from ascend_dist.common.errors import IncompatiblePeer, LeaseExpired, ProtocolError
from ascend_dist.common.wire import Codec, Handshake
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.core.capability import Grant
from ascend_dist.kv_mooncake.core.messages import Ack, AgentMetadata, GetMeta, MetaReply, accept_reply
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.messages import (
    MAX_BATCH,
    DoneItem,
    Dones,
    Held,
    Renew,
    Reply,
    Request,
    reply_codec,
    request_codec,
)

__all__ = ["LeaseAsk", "PeerClient", "PeerRestarted"]

logger = logging.getLogger(__name__)


class PeerRestarted(LeaseExpired):
    """The P worker that answered is another process than the one whose metadata D read with.

    A P restarted on its side-channel port, with no failed transfer from it in between, would
    otherwise be read at the dead process's session and addresses. P is alive: not a breaker trip.
    """


class LeaseAsk(NamedTuple):
    """One request of a `Renew`: P's request id and grant, the D task's DONE sender, the pull's token."""

    request_id: str
    grant: Grant | None
    sender: str
    reader: str


class PeerClient:
    """Requests from one D worker to the P workers it reads."""

    def __init__(self, config: PullConfig, handshake: Handshake, d_rank: int) -> None:
        """Create the client (sockets are opened per request by `RpcClient`)."""
        self._config = config
        self._handshake = handshake
        self._d_rank = d_rank
        self._client = RpcClient(
            timeout_s=config.rpc_timeout_s, retries=config.rpc_retries, max_reply_bytes=config.max_message_bytes
        )
        self._requests: Codec[Request] = request_codec(config.max_message_bytes)
        self._replies: Codec[Reply] = reply_codec(config.max_message_bytes)
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str, int], AgentMetadata] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)

    def cached(self, engine_id: str, host: str, port: int) -> AgentMetadata | None:
        """The cached metadata of a P worker, if fetched."""
        with self._lock:
            return self._cache.get((engine_id, host, port))

    def forget(self, engine_id: str, host: str, port: int) -> None:
        """Drop a P worker's cached metadata (after a failed transfer from it)."""
        with self._lock:
            self._cache.pop((engine_id, host, port), None)

    def metadata(self, engine_id: str, host: str, port: int) -> AgentMetadata:
        """A P worker's metadata: cached, or fetched after the handshake.

        Raises:
            IncompatiblePeer: P refused D's handshake, D refuses P's, or the engine id differs.
            ProtocolError: An unexpected reply.
            DeadlineExceeded: P did not answer within the retries.
        """
        cached = self.cached(engine_id, host, port)
        if cached is not None:
            return cached
        if engine_id == self._config.engine_id:
            raise IncompatiblePeer("engine_id", self._config.engine_id, engine_id)
        greeting = GetMeta(handshake=self._handshake, engine_id=self._config.engine_id)
        reply = accept_reply(self._rpc(host, port, greeting), MetaReply, self._handshake, f"{host}:{port}")
        if reply.metadata.engine_id != engine_id:
            raise IncompatiblePeer("remote_engine_id", engine_id, reply.metadata.engine_id)
        with self._lock:
            self._cache[(engine_id, host, port)] = reply.metadata
        return reply.metadata

    def renew(self, host: str, port: int, requests: Sequence[LeaseAsk], *, incarnation: str = "") -> list[float | None]:
        """Extend the leases of ``requests`` on one P worker, as their readers.

        Returns, per request, None when P no longer holds its blocks (for this reader), else the
        seconds P promised to keep them from its answer (0: no promise, e.g. not lent yet). One
        `Renew` per `MAX_BATCH` requests. A grant is P's signed capability (a P with a secret renews
        nothing without it). ``incarnation``: that of the metadata D will read with (empty: not
        checked).

        Raises:
            PeerRestarted: P answered from another process than ``incarnation``'s.
            ProtocolError: An unexpected reply or one with another count (and like `metadata` on
                a dead or slow P).
        """
        out: list[float | None] = []
        for start in range(0, len(requests), MAX_BATCH):
            part = requests[start : start + MAX_BATCH]
            grants = [a.grant for a in part if a.grant is not None]
            ids = [a.request_id for a in part]
            renew = Renew(
                request_ids=ids,
                grants=grants if len(grants) == len(ids) else [],
                d_rank=self._d_rank,
                senders=[a.sender for a in part],
                readers=[a.reader for a in part],
            )
            reply = self._rpc(host, port, renew)
            if not isinstance(reply, Held) or len(reply.held) != len(ids) or len(reply.lease_s) not in (0, len(ids)):
                raise ProtocolError(f"expected {len(ids)} held flags from {host}:{port}, got {type(reply).__name__}")
            if incarnation and reply.incarnation and reply.incarnation != incarnation:
                raise PeerRestarted(
                    f"P {host}:{port} restarted since D fetched its metadata (process {incarnation}, "
                    f"now {reply.incarnation}): its requests are recomputed, the next ones fetch it again"
                )
            promised = reply.lease_s or [0.0] * len(ids)
            out += [lease if held else None for held, lease in zip(reply.held, promised, strict=True)]
        return out

    def send_dones(self, host: str, port: int, items: Sequence[DoneItem]) -> None:
        """Tell a P worker D is done with these requests; never raises (P's lease frees them if lost).

        Each item's ``sender`` names the D task beside this rank (P counts each (rank, sender)
        once, so a resent copy never frees blocks another D task still reads). One `Dones` per
        `MAX_BATCH` items.
        """
        for start in range(0, len(items), MAX_BATCH):
            part = list(items[start : start + MAX_BATCH])
            try:
                reply = self._rpc(host, port, Dones(d_rank=self._d_rank, items=part))
                if not isinstance(reply, Ack):
                    logger.warning("DONEs to %s:%d answered by %s", host, port, type(reply).__name__)
            except Exception as exc:
                logger.warning("%d DONEs to %s:%d not delivered: %s", len(part), host, port, exc)

    def _rpc(self, host: str, port: int, message: Request) -> Reply:
        body = self._client.request(tcp_endpoint(host, port), self._requests.encode(message))
        return self._replies.decode(body)

    def close(self) -> None:
        """Close the sockets."""
        self._client.close()
