"""The lookup client's two paths: a direct call to a server of this process, or the RPC."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from ascend_dist.common.errors import StoreError
from ascend_dist.kv_store import LookupClient, LookupServer
from ascend_dist.kv_store.messages import LookupRequest

COMPAT = "c" * 64


def _port(server: LookupServer) -> int:
    return int(server.endpoint.rsplit(":", 1)[1])


@pytest.mark.parametrize("in_process", [True, False], ids=["direct", "rpc"])
def test_both_paths_answer_alike(kvtools, in_process: bool) -> None:
    threads: list[str] = []

    def lookup(req: LookupRequest) -> int:
        threads.append(threading.current_thread().name)
        if req.token_len == 13:
            raise StoreError("store down")
        return req.token_len // 2

    server = LookupServer(lookup, COMPAT, port=kvtools.free_port())
    client = LookupClient(COMPAT, port=_port(server), timeout_s=2, in_process=in_process)
    other = LookupClient("0" * 64, port=_port(server), timeout_s=2, in_process=in_process)
    try:
        assert client.lookup(64, (b"h" * 32,) * 4) == 32
        assert client.lookup(13, ()) == 0 and client.failures == 1  # a raising lookup is a miss
        assert other.lookup(64, ()) == 0 and other.failures == 1  # another key scheme is refused
        assert len(threads) == 2  # the refused scheme never reached the lookup
        expected = (2, 0) if in_process else (0, 2)
        assert (client.local_lookups, client.rpc_lookups) == expected
        caller = threading.current_thread().name
        assert all((name == caller) == in_process for name in threads)
    finally:
        client.close()
        other.close()
        server.close()


def test_a_closed_server_is_never_called_directly(kvtools) -> None:
    port = kvtools.free_port()
    server = LookupServer(lambda r: 16, COMPAT, port=port)
    client = LookupClient(COMPAT, port=port, timeout_s=0.2)
    try:
        assert client.lookup(32, ()) == 16 and client.local_lookups == 1
        server.close()
        assert client.lookup(32, ()) == 0  # nothing listens now: a bounded miss over the RPC
        assert client.rpc_lookups == 1 and client.failures == 1
    finally:
        client.close()
        server.close()


def _child_lookup(port: int) -> None:
    client = LookupClient(COMPAT, port=port, timeout_s=5)
    hits = client.lookup(64, ())
    client.close()
    os._exit(0 if (hits, client.local_lookups, client.rpc_lookups) == (48, 0, 1) else 1)


def test_a_forked_child_asks_its_parent_over_the_rpc(kvtools) -> None:
    """The child inherits the registry entry but not the server thread: it must not call it."""
    server = LookupServer(lambda r: 48, COMPAT, port=kvtools.free_port())
    try:
        child = multiprocessing.get_context("fork").Process(target=_child_lookup, args=(_port(server),))
        child.start()
        child.join(30)
        if child.exitcode is None:
            child.kill()
            child.join(5)
        assert child.exitcode == 0
    finally:
        server.close()
