"""The lookup client's two paths: a direct call to a server of this process, or the RPC."""

from __future__ import annotations

import multiprocessing
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from ascend_dist.common.errors import StoreError
from ascend_dist.kv_store import LookupClient, LookupServer
from ascend_dist.kv_store.lookup.lookup_endpoint import EndpointError, endpoint_dir, endpoint_file, read_endpoint
from ascend_dist.kv_store.lookup.messages import LookupRequest
from ascend_dist.testing.ports import free_port

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


# ---- endpoint files: one per instance, in a private directory (issue 21 fault 6) ----


def _recording_server(hits: int, env: dict[str, str], instance: str, calls: list[int]) -> LookupServer:
    def lookup(req: LookupRequest) -> int:
        calls.append(req.token_len)
        return hits

    return LookupServer(lookup, COMPAT, instance=instance, env=env)


def test_two_instances_on_one_host_reach_their_own_servers(tmp_path) -> None:
    env = {"VLLM_RPC_BASE_PATH": str(tmp_path)}
    calls_a: list[int] = []
    calls_b: list[int] = []
    a = _recording_server(16, env, "engine-a", calls_a)
    b = _recording_server(32, env, "engine-b", calls_b)  # published second: it took the one shared file before
    clients = [
        LookupClient(COMPAT, instance=i, env=env, timeout_s=2, in_process=False) for i in ("engine-a", "engine-b")
    ]
    try:
        assert [c.lookup(64, ()) for c in clients] == [16, 32]
        assert (calls_a, calls_b) == ([64], [64])
    finally:
        for c in clients:
            c.close()
        a.close()
        b.close()


def _published(env: dict[str, str], instance: str) -> Path:
    return endpoint_file(instance, 0, env)


@pytest.mark.parametrize("plant", ["open-mode", "symlink", "foreign-owner", "not-loopback", "garbage"])
def test_a_planted_endpoint_file_is_refused(tmp_path, plant: str) -> None:
    env = {"VLLM_RPC_BASE_PATH": str(tmp_path)}
    calls: list[int] = []
    decoy = LookupServer(lambda r: calls.append(r.token_len) or 64, COMPAT, port=free_port())
    path = endpoint_file("engine-a", 0, env, create=True)
    text = f"{decoy.endpoint} {os.getpid()}\n"
    if plant == "symlink":
        target = tmp_path / "elsewhere"
        target.write_text(text)
        target.chmod(0o600)
        path.symlink_to(target)
    else:
        if plant == "not-loopback":
            text = text.replace("127.0.0.1", "192.0.2.9")
        elif plant == "garbage":
            text = text.replace("127.0.0.1", "999.0.0.1")
        path.write_text(text)
        path.chmod(0o644 if plant == "open-mode" else 0o600)
        if plant == "foreign-owner":
            if os.geteuid() != 0:
                pytest.skip("needs root to give the file to another user")
            os.chown(path, 65534, 65534)
    client = LookupClient(COMPAT, instance="engine-a", env=env, timeout_s=0.5, in_process=False)
    try:
        with pytest.raises(EndpointError):
            read_endpoint(path)
        assert client.lookup(64, ()) == 0 and client.failures == 1
        assert calls == []  # the decoy never heard from the client
        with pytest.raises(EndpointError):  # a server of that instance does not take over the planted file
            LookupServer(lambda r: 0, COMPAT, instance="engine-a", env=env)
    finally:
        client.close()
        decoy.close()


@pytest.mark.parametrize("problem", ["mode-0755", "symlink"])
def test_an_open_or_linked_endpoint_directory_is_refused(tmp_path, problem: str) -> None:
    env = {"VLLM_RPC_BASE_PATH": str(tmp_path)}
    path = endpoint_dir(env)
    if problem == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "real")
    else:
        path.mkdir()
        path.chmod(0o755)
    with pytest.raises(EndpointError, match="lookup endpoint directory"):
        LookupServer(lambda r: 0, COMPAT, instance="engine-a", env=env)
    with pytest.raises(EndpointError):
        LookupClient(COMPAT, instance="engine-a", env=env)
    path.unlink() if problem == "symlink" else path.chmod(0o700)  # control: the private directory works
    server = LookupServer(lambda r: 8, COMPAT, instance="engine-a", env=env)
    client = LookupClient(COMPAT, instance="engine-a", env=env, timeout_s=2, in_process=False)
    try:
        assert client.lookup(16, ()) == 8
        assert stat.S_IMODE(os.stat(endpoint_dir(env)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(_published(env, "engine-a")).st_mode) == 0o600
    finally:
        client.close()
        server.close()


def test_a_live_instance_id_is_not_taken_over(tmp_path) -> None:
    """A second process with the same engine_id must not steal the first one's lookups."""
    env = {"VLLM_RPC_BASE_PATH": str(tmp_path)}
    path = endpoint_file("engine-a", 0, env, create=True)
    path.write_text(f"tcp://127.0.0.1:{free_port()} {os.getppid()}\n")  # a live process of this user
    path.chmod(0o600)
    with pytest.raises(EndpointError, match="engine_id"):
        LookupServer(lambda r: 0, COMPAT, instance="engine-a", env=env)
    path.write_text(f"tcp://127.0.0.1:{free_port()} 999999999\n")  # control: a dead publisher's file is replaced
    server = LookupServer(lambda r: 4, COMPAT, instance="engine-a", env=env)
    try:
        assert read_endpoint(path) == (server.endpoint, os.getpid())
    finally:
        server.close()
    assert not path.exists()


# ---- the lookup breaker: a hung lookup path costs one timeout, not one per waiting request (fault 8) ----


def _hung_listener(port: int) -> socket.socket:
    """A real TCP server that accepts connections (kernel backlog) and never reads or answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(64)
    return sock


def test_a_hung_lookup_server_costs_one_timeout_and_hits_resume_after_it_answers(kvtools) -> None:
    port = kvtools.free_port()
    hung = _hung_listener(port)
    client = LookupClient(COMPAT, port=port, timeout_s=0.3, in_process=False)
    server = None
    try:
        t0 = time.monotonic()
        answers = [client.lookup(64, (b"h" * 32,) * 4) for _ in range(10)]  # ten waiting requests in one step
        elapsed = time.monotonic() - t0
        assert answers == [0] * 10
        one_timeout = 2 * 0.3 + 0.05  # the RPC's two attempts and the pause between them
        assert elapsed < 2 * one_timeout, f"10 lookups took {elapsed:.2f}s (one timeout is {one_timeout:.2f}s)"
        assert client.rpc_lookups == 1 and client.short_circuits == 9
        hung.close()
        server = LookupServer(lambda r: 32, COMPAT, port=port)  # the store answers again, same endpoint
        assert client.lookup(64, ()) == 0  # still inside the backoff window: a miss at once
        deadline = time.monotonic() + 30
        while client.lookup(64, ()) != 32:  # the half-open probe closes the breaker once it is answered
            assert time.monotonic() < deadline, "hits never resumed"
            time.sleep(0.05)
        assert client.lookup(64, ()) == 32 and client.breaker_open is False
    finally:
        hung.close()
        client.close()
        if server is not None:
            server.close()


def test_a_probe_into_a_still_hung_server_reopens_for_longer(kvtools) -> None:
    port = kvtools.free_port()
    hung = _hung_listener(port)
    client = LookupClient(COMPAT, port=port, timeout_s=0.2, in_process=False, backoff_s=0.3, max_backoff_s=0.6)
    try:
        assert client.lookup(64, ()) == 0 and client.breaker_open  # trips
        time.sleep(0.35)
        t0 = time.monotonic()
        assert client.lookup(64, ()) == 0  # the probe: one more timeout
        assert time.monotonic() - t0 >= 0.2 and client.rpc_lookups == 2
        time.sleep(0.35)  # the first window's length: the doubled one has not passed
        t0 = time.monotonic()
        assert client.lookup(64, ()) == 0 and time.monotonic() - t0 < 0.1  # still open: no third timeout
        assert client.rpc_lookups == 2
    finally:
        hung.close()
        client.close()


def test_a_slow_direct_lookup_trips_the_breaker_too(kvtools) -> None:
    """Same process (vLLM's uniprocess executor): the direct call has no RPC deadline, so its time is measured."""
    calls: list[int] = []

    def slow(req: LookupRequest) -> int:
        calls.append(req.token_len)
        time.sleep(0.4)  # the worker stuck on a store that accepts and never answers
        return 16

    port = kvtools.free_port()
    server = LookupServer(slow, COMPAT, port=port)
    client = LookupClient(COMPAT, port=port, timeout_s=0.2, backoff_s=30)
    try:
        t0 = time.monotonic()
        assert [client.lookup(64, ()) for _ in range(5)] == [16, 0, 0, 0, 0]
        assert time.monotonic() - t0 < 0.4 + 0.2 and len(calls) == 1
    finally:
        client.close()
        server.close()
