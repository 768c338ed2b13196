"""The lookup RPC: `LookupServer` on the rank-0 worker, `LookupClient` in the scheduler.

Runs in: the rank-0 worker (server thread) and the scheduler (client, on its own thread).
Transport: `ascend_dist.common.zmq_rpc` (ROUTER/DEALER over TCP on loopback, msgspec frames,
deadline per attempt, bounded retries). Upstream used a REQ socket without timeout, so a dead worker
blocked the scheduler forever; here a lookup that misses its deadline counts as zero
hits, with one warning.

Endpoint discovery: with ``lookup_rpc_port`` set the server binds ``127.0.0.1:port + dp_rank``;
with 0 (the default) it binds an OS-assigned port (no "address in use" when instances start
together, upstream issues #8938/#15358) and publishes the endpoint in a file named per instance
(vLLM's ``engine_id``) and DP rank, in a private directory:
``{VLLM_RPC_BASE_PATH or tmp}/ascend-dist-lookup-{uid}/{instance}_dp{dp}.endpoint``. Upstream used
one name per host, so a second instance captured the first one's lookups and anyone on the host
could plant the file. The directory is created 0700 and, like the file (0600), must be owned by
this user and closed to others, or it is refused with `EndpointError`: the server does not start,
the client answers misses.

Same process: with vLLM's single-process executor (TP=1, the default on one device) the scheduler
and the rank-0 worker share a process. The client then finds the server in a per-process registry
and calls it directly, with the same compatibility check and error handling but without the
loopback round trip (~0.15-0.3 ms of a ~0.5 ms lookup here). A forked child never uses its parent's
servers (the registry is keyed by pid). The direct call has no RPC deadline: it is bounded by the
store client's own timeouts and the backend's circuit breaker, like the server thread it replaces.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping

from ascend_dist.common.errors import DeadlineExceeded, ProtocolError
from ascend_dist.common.log import IntervalLog, log_once
from ascend_dist.common.zmq_rpc import RpcClient, RpcServer
from ascend_dist.kv_store.lookup.lookup_breaker import LookupBreaker
from ascend_dist.kv_store.lookup.lookup_endpoint import (
    EndpointError,
    check_endpoint_dir,
    endpoint_file,
    publish_endpoint,
    read_endpoint,
)
from ascend_dist.kv_store.lookup.messages import PROTOCOL_VERSION, LookupCodec, LookupReply, LookupRequest, ReplyCodec

__all__ = ["LookupClient", "LookupServer"]

logger = logging.getLogger(__name__)
_BAD_FRAMES = IntervalLog(10.0)  # junk frames can arrive at any rate: log a line per interval

LookupFn = Callable[[LookupRequest], int]

_local_lock = threading.Lock()
_local_servers: dict[str, tuple[int, LookupServer]] = {}  # endpoint -> (pid that bound it, server)


def _local_server(endpoint: str) -> LookupServer | None:
    """The live server of this process bound to ``endpoint``, if any."""
    entry = _local_servers.get(endpoint)
    if entry is None or entry[0] != os.getpid():
        return None
    return entry[1]


class LookupServer:
    """Answers `LookupRequest` frames with the worker's hit count; survives bad frames."""

    def __init__(
        self,
        lookup: LookupFn,
        compat_hash: str,
        *,
        port: int = 0,
        dp_rank: int = 0,
        instance: str = "",
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Bind and start serving; with ``port`` 0, publish the endpoint file of ``instance``.

        Raises:
            ConfigError: The port is in use, the host is not local, or ``port`` is 0 and
                ``instance`` is empty.
            EndpointError: The endpoint directory or an existing file is not private, or another
                live process already publishes the same instance id there.
        """
        self._lookup = lookup
        self._compat = compat_hash
        self._file = endpoint_file(instance, dp_rank, env, create=True) if not port else None
        self._server = RpcServer(host, port + dp_rank if port else 0, self._handle, name="kv-pool-lookup")
        if self._file is not None:
            try:
                publish_endpoint(self._file, self._server.endpoint)
            except BaseException:
                self._server.stop()
                raise
        self._server.start()
        with _local_lock:
            _local_servers[self._server.endpoint] = (os.getpid(), self)

    @property
    def endpoint(self) -> str:
        """The bound endpoint."""
        return self._server.endpoint

    def _handle(self, payload: bytes) -> bytes:
        try:
            req = LookupCodec.decode(payload)
        except ProtocolError as exc:  # hostile or foreign: one line per interval, with a count
            _BAD_FRAMES.log(
                logger, logging.WARNING, "undecodable", "lookup server refused an undecodable request: %s", exc
            )
            return ReplyCodec.encode(LookupReply(hit_tokens=0, error="undecodable request"))
        return ReplyCodec.encode(self.answer(req))

    def answer(self, req: LookupRequest) -> LookupReply:
        """Check ``req``'s key scheme and run the lookup; any failure is 0 hits with the reason."""
        if req.protocol_version != PROTOCOL_VERSION or req.compat_hash != self._compat:
            error = (
                f"incompatible key scheme: protocol {req.protocol_version} vs {PROTOCOL_VERSION}, "
                f"compat {req.compat_hash[:12]} vs {self._compat[:12]}"
            )
            log_once(logger, logging.WARNING, "lookup refused: %s", error, key=("compat", req.compat_hash))
            return LookupReply(hit_tokens=0, error=error)
        try:
            hits = self._lookup(req)
        except Exception as exc:  # the store client may raise anything: a lookup failure is a miss
            logger.warning("lookup failed (%s: %s); answering 0 hits", type(exc).__name__, exc)
            return LookupReply(hit_tokens=0, error=f"{type(exc).__name__}: {exc}")
        return LookupReply(hit_tokens=hits)

    def close(self) -> None:
        """Stop the server thread, close the socket and remove the endpoint file. Idempotent."""
        with _local_lock:
            if _local_server(self._server.endpoint) is self:
                del _local_servers[self._server.endpoint]
        self._server.stop()
        if self._file is None:
            return
        try:
            current = read_endpoint(self._file)
            if current is not None and current[0] == self._server.endpoint:
                self._file.unlink()
        except (OSError, EndpointError):
            pass  # not ours to remove


class LookupClient:
    """Asks the rank-0 worker for hits; any failure is a miss with one warning."""

    def __init__(
        self,
        compat_hash: str,
        *,
        port: int = 0,
        dp_rank: int = 0,
        instance: str = "",
        host: str = "127.0.0.1",
        timeout_s: float = 1.0,
        env: Mapping[str, str] | None = None,
        in_process: bool = True,
        backoff_s: float = 2.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        """Create the client; nothing is connected until the first lookup.

        A lookup that times out (over the RPC, or a direct call slower than ``timeout_s``) opens
        the `LookupBreaker`: misses at once for ``backoff_s``, doubling per failed probe up to
        ``max_backoff_s``.

        With ``port`` 0 it reads the endpoint the server of ``instance`` (vLLM's ``engine_id``) and
        ``dp_rank`` published. ``in_process=False`` always goes over the RPC, even to a server of
        this process.

        Raises:
            ConfigError: ``port`` is 0 and ``instance`` is empty.
            EndpointError: The endpoint directory exists and is not private.
        """
        self._compat = compat_hash
        self._fixed = f"tcp://{host}:{port + dp_rank}" if port else None
        self._file = endpoint_file(instance, dp_rank, env) if not port else None
        self._rpc = RpcClient(timeout_s=timeout_s, retries=2, retry_delay_s=0.05)
        self._in_process = in_process
        self._timeout_s = timeout_s
        self._breaker = LookupBreaker(backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self.failures = 0
        self.rpc_lookups = 0
        self.local_lookups = 0
        self.short_circuits = 0  # lookups answered as misses while the breaker was open

    @property
    def breaker_open(self) -> bool:
        """Whether lookups are answered as misses (a lookup timed out and no probe succeeded since)."""
        return self._breaker.is_open

    def _endpoint(self) -> str | None:
        if self._fixed is not None or self._file is None:
            return self._fixed
        try:
            check_endpoint_dir(self._file.parent)
            found = read_endpoint(self._file)
        except FileNotFoundError:
            return None
        except (OSError, EndpointError) as exc:
            log_once(logger, logging.ERROR, "KV pool lookup endpoint refused: %s; reporting misses", exc,
                     key=("endpoint-refused", str(self._file)))  # fmt: skip
            return None
        return found[0] if found is not None else None

    def lookup(
        self,
        token_len: int,
        block_hashes: tuple[bytes, ...],
        group_ids: tuple[int, ...] = (0,),
        hbm_hit_tokens: int = 0,
        tail_hash: bytes = b"",
    ) -> int:
        """Hit tokens for the prompt; 0 on any failure (logged once per kind) and while the breaker is open."""
        if not self._breaker.allow():
            self.short_circuits += 1
            return 0
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
        server = _local_server(endpoint) if self._in_process else None
        if server is not None:
            self.local_lookups += 1
            started = time.monotonic()
            reply = server.answer(req)
            took = time.monotonic() - started
            if took > self._timeout_s:  # no RPC deadline here: a slow store is caught by its time
                self._breaker.timed_out(f"a direct lookup took {took:.2f}s (timeout {self._timeout_s}s)")
            else:
                self._breaker.answered()
            return self._hits(reply, token_len)
        self.rpc_lookups += 1
        try:
            reply = ReplyCodec.decode(self._rpc.request(endpoint, LookupCodec.encode(req)))
        except (DeadlineExceeded, ProtocolError) as exc:
            if isinstance(exc, DeadlineExceeded):
                self._breaker.timed_out(f"lookup at {endpoint} timed out")
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
        self._breaker.answered()
        return self._hits(reply, token_len)

    def _hits(self, reply: LookupReply, token_len: int) -> int:
        if reply.error:
            self.failures += 1
            log_once(logger, logging.WARNING, "KV pool lookup refused: %s", reply.error, key=("refused", reply.error))
        return max(0, min(reply.hit_tokens, token_len))

    def close(self) -> None:
        """Close the client's sockets."""
        self._rpc.close()
