"""The lookup RPC: `LookupServer` on the rank-0 worker, `LookupClient` in the scheduler.

Runs in: the rank-0 worker (server thread) and the scheduler (client, on its own thread).
Transport: `ascend_dist.common.zmq_rpc` (ROUTER/DEALER over TCP on loopback, msgspec frames,
deadline per attempt, bounded retries). Upstream used a REQ socket without timeout, so a dead worker
blocked the scheduler forever (spec §19.11); here a lookup that misses its deadline counts as zero
hits, with one warning.

Endpoint discovery: with ``lookup_rpc_port`` set the server binds ``127.0.0.1:port + dp_rank``;
with 0 (the default) it binds an OS-assigned port (no "address in use" when instances start
together, upstream issues #8938/#15358) and writes the endpoint to
``{VLLM_RPC_BASE_PATH or tmp}/lookup_rpc_port_{port}_dp_rank{dp}.endpoint``, which the client reads.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from ascend_dist.common.errors import DeadlineExceeded, ProtocolError
from ascend_dist.common.log import log_once
from ascend_dist.common.zmq_rpc import RpcClient, RpcServer
from ascend_dist.kv_store.messages import PROTOCOL_VERSION, LookupCodec, LookupReply, LookupRequest, ReplyCodec

__all__ = ["LookupClient", "LookupServer", "endpoint_file"]

logger = logging.getLogger(__name__)

LookupFn = Callable[[LookupRequest], int]


def endpoint_file(port: int, dp_rank: int, env: Mapping[str, str] | None = None) -> Path:
    """Where the rank-0 worker of engine ``dp_rank`` publishes its lookup endpoint."""
    env = os.environ if env is None else env
    base = env.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    return Path(base) / f"lookup_rpc_port_{port}_dp_rank{dp_rank}.endpoint"


class LookupServer:
    """Answers `LookupRequest` frames with the worker's hit count; survives bad frames."""

    def __init__(
        self,
        lookup: LookupFn,
        compat_hash: str,
        *,
        port: int = 0,
        dp_rank: int = 0,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Bind and start serving; publish the endpoint file.

        Raises:
            ConfigError: The port is in use or the host is not local.
        """
        self._lookup = lookup
        self._compat = compat_hash
        self._server = RpcServer(host, port + dp_rank if port else 0, self._handle, name="kv-pool-lookup")
        self._file = endpoint_file(port, dp_rank, env)
        tmp = self._file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(self._server.endpoint, encoding="utf-8")
        tmp.replace(self._file)
        self._server.start()

    @property
    def endpoint(self) -> str:
        """The bound endpoint."""
        return self._server.endpoint

    def _handle(self, payload: bytes) -> bytes:
        try:
            req = LookupCodec.decode(payload)
        except ProtocolError as exc:
            logger.warning("lookup server dropped an undecodable request: %s", exc)
            return ReplyCodec.encode(LookupReply(hit_tokens=0, error="undecodable request"))
        if req.protocol_version != PROTOCOL_VERSION or req.compat_hash != self._compat:
            error = (
                f"incompatible key scheme: protocol {req.protocol_version} vs {PROTOCOL_VERSION}, "
                f"compat {req.compat_hash[:12]} vs {self._compat[:12]}"
            )
            log_once(logger, logging.WARNING, "lookup refused: %s", error, key=("compat", req.compat_hash))
            return ReplyCodec.encode(LookupReply(hit_tokens=0, error=error))
        try:
            hits = self._lookup(req)
        except Exception as exc:  # the store client may raise anything: a lookup failure is a miss
            logger.warning("lookup failed (%s: %s); answering 0 hits", type(exc).__name__, exc)
            return ReplyCodec.encode(LookupReply(hit_tokens=0, error=f"{type(exc).__name__}: {exc}"))
        return ReplyCodec.encode(LookupReply(hit_tokens=hits))

    def close(self) -> None:
        """Stop the server thread, close the socket and remove the endpoint file. Idempotent."""
        self._server.stop()
        try:
            if self._file.read_text(encoding="utf-8") == self._server.endpoint:
                self._file.unlink()
        except OSError:
            pass


class LookupClient:
    """Asks the rank-0 worker for hits; any failure is a miss with one warning."""

    def __init__(
        self,
        compat_hash: str,
        *,
        port: int = 0,
        dp_rank: int = 0,
        host: str = "127.0.0.1",
        timeout_s: float = 1.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Create the client; nothing is connected until the first lookup."""
        self._compat = compat_hash
        self._fixed = f"tcp://{host}:{port + dp_rank}" if port else None
        self._file = endpoint_file(port, dp_rank, env)
        self._rpc = RpcClient(timeout_s=timeout_s, retries=2, retry_delay_s=0.05)
        self.failures = 0

    def _endpoint(self) -> str | None:
        if self._fixed is not None:
            return self._fixed
        try:
            return self._file.read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def lookup(
        self,
        token_len: int,
        block_hashes: tuple[bytes, ...],
        group_ids: tuple[int, ...] = (0,),
        hbm_hit_tokens: int = 0,
        tail_hash: bytes = b"",
    ) -> int:
        """Hit tokens for the prompt; 0 on any failure (logged once per kind)."""
        endpoint = self._endpoint()
        if endpoint is None:
            self.failures += 1
            log_once(
                logger,
                logging.WARNING,
                "KV pool lookup server not published at %s; reporting misses",
                self._file,
                key="no-endpoint",
            )
            return 0
        req = LookupRequest(
            compat_hash=self._compat,
            token_len=token_len,
            group_ids=group_ids,
            hbm_hit_tokens=hbm_hit_tokens,
            block_hashes=block_hashes,
            tail_hash=tail_hash,
        )
        try:
            reply = ReplyCodec.decode(self._rpc.request(endpoint, LookupCodec.encode(req)))
        except (DeadlineExceeded, ProtocolError) as exc:
            self.failures += 1
            log_once(
                logger,
                logging.WARNING,
                "KV pool lookup at %s failed (%s); reporting misses",
                endpoint,
                exc,
                key=("lookup-failed", endpoint),
            )
            return 0
        if reply.error:
            self.failures += 1
            log_once(logger, logging.WARNING, "KV pool lookup refused: %s", reply.error, key=("refused", reply.error))
        return max(0, min(reply.hit_tokens, token_len))

    def close(self) -> None:
        """Close the client's sockets."""
        self._rpc.close()
