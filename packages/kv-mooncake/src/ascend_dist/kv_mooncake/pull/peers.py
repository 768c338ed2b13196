"""D's side-channel client to P workers: handshake and metadata cache, lease renewal, DONE.

Runs in: D worker processes (the receiver's pool threads; thread-safe). Every request has the
deadline and retries of `ascend_dist.common.zmq_rpc.RpcClient`; replies are decoded strictly. A P
worker's metadata is fetched once after a compatibility handshake and cached per (engine id,
host, port) until a transfer from it fails (`forget`): a P restarted on the same port must not be
read with stale addresses.
"""

from __future__ import annotations

import logging
import threading

from ascend_dist.common.errors import IncompatiblePeer, ProtocolError
from ascend_dist.common.wire import Codec, Handshake
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.core.capability import Grant
from ascend_dist.kv_mooncake.core.messages import Ack, AgentMetadata, Done, GetMeta, MetaReply, accept_reply
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.messages import Renew, Reply, Request, reply_codec, request_codec

__all__ = ["PeerClient"]

logger = logging.getLogger(__name__)


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

    def renew(self, host: str, port: int, remote_request_id: str, grant: Grant | None = None) -> bool:
        """Extend the lease of a request's blocks on one P worker; whether P still holds them.

        ``grant``: P's signed capability for the request (a P with a secret renews nothing without it).

        Raises:
            ProtocolError: An unexpected reply (and like `metadata` on a dead or slow P).
        """
        grants = [grant] if grant is not None else []
        reply = self._rpc(host, port, Renew(request_ids=[remote_request_id], grants=grants))
        if not isinstance(reply, Ack):
            raise ProtocolError(f"expected an ack from {host}:{port}, got {type(reply).__name__}")
        return reply.known

    def send_done(
        self,
        host: str,
        port: int,
        remote_request_id: str,
        ok: bool,
        *,
        sender: str = "",
        grant: Grant | None = None,
    ) -> None:
        """Tell a P worker D is done with a request; never raises (P's lease frees the blocks if lost).

        ``sender`` names the D task beside this rank (P counts each (rank, sender) once, so a
        resent copy never frees blocks another D task still reads). ``grant``: as for `renew`.
        """
        try:
            done = Done(request_id=remote_request_id, d_rank=self._d_rank, ok=ok, sender=sender, grant=grant)
            reply = self._rpc(host, port, done)
            if not isinstance(reply, Ack):
                logger.warning("DONE for %s to port %d answered by %s", remote_request_id, port, type(reply).__name__)
        except Exception as exc:
            logger.warning("DONE for %s to %s:%d not delivered: %s", remote_request_id, host, port, exc)

    def _rpc(self, host: str, port: int, message: Request) -> Reply:
        body = self._client.request(tcp_endpoint(host, port), self._requests.encode(message))
        return self._replies.decode(body)

    def close(self) -> None:
        """Close the sockets."""
        self._client.close()
