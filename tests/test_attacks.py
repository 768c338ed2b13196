"""Attack suite: hostile frames against real servers on 127.0.0.1, each refused in bounded time
while legitimate traffic is still served (issues 23 and 24). More cases live with their packages:
``packages/common/tests/wire/test_wire_rpc_bounds.py`` (floods, slow senders, log flooding),
``packages/kv-mooncake/tests/test_wire.py`` (channel binding, other wire versions, bounded fields,
refusals without our values), ``packages/kv-mooncake/tests/test_pd_failures.py`` (a real P),
``packages/kv-mooncake/tests/test_pd_capabilities.py`` (signed pull capabilities against a real P:
block ids widened to another live request's, forged ``Renew`` and ``Done``) and
``packages/kv-mooncake/tests/push/test_lw_capabilities.py`` (signed push announcements)."""

from __future__ import annotations

import logging
import resource
import threading
from typing import Any

import msgspec
import pytest

from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.kv_store import LookupServer
from ascend_dist.kv_store.lookup.messages import LookupCodec, LookupRequest, ReplyCodec
from ascend_dist.testing.ports import free_port

COMPAT = "c" * 64


def _lookup_frame(**fields: Any) -> bytes:
    return msgspec.msgpack.encode({"kind": "lookup", "compat_hash": COMPAT, "token_len": 64, **fields})


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "fields",
    [
        {"hbm_hit_tokens": -(10**9)},  # upstream-style range(known, n): ~3 GiB before this was checked
        {"token_len": -1},
        {"token_len": 2**62},
        {"group_ids": [10**9]},
        {"group_ids": []},
        {"block_hashes": [b"h" * 4096]},
        {"tail_hash": b"t" * 4096},
    ],
    ids=lambda f: next(iter(f)),
)
def test_lookup_fields_out_of_range_are_refused_before_the_lookup_runs(fields: dict[str, Any]) -> None:
    asked: list[LookupRequest] = []

    def lookup(req: LookupRequest) -> int:
        asked.append(req)
        return req.token_len

    server = LookupServer(lookup, COMPAT, host="127.0.0.1", port=free_port())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with RpcClient(timeout_s=10.0, retries=1) as client:
            reply = ReplyCodec.decode(client.request(server.endpoint, _lookup_frame(**fields)))
            assert reply.hit_tokens == 0 and reply.error and not asked
            # Control: the same frame with legal values reaches the lookup and is answered.
            good = LookupCodec.encode(LookupRequest(compat_hash=COMPAT, token_len=64, block_hashes=(b"h" * 32,)))
            assert ReplyCodec.decode(client.request(server.endpoint, good)).hit_tokens == 64 and len(asked) == 1
    finally:
        server.close()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024  # KiB: < 200 MiB


@pytest.mark.timeout(60)
def test_a_junk_flood_is_logged_once_per_interval_and_lookups_are_still_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = LookupServer(lambda req: req.token_len, COMPAT, host="127.0.0.1", port=free_port())
    threads_before = threading.active_count()
    good = LookupCodec.encode(LookupRequest(compat_hash=COMPAT, token_len=32))
    try:
        with caplog.at_level(logging.WARNING), RpcClient(timeout_s=10.0, retries=1) as client:
            for i in range(2000):  # 16-byte junk frames, each answered with an error reply
                reply = ReplyCodec.decode(client.request(server.endpoint, b"\xc1" + i.to_bytes(15, "big")))
                assert reply.hit_tokens == 0 and reply.error
                if i % 500 == 0:  # legitimate lookups in between are answered correctly
                    assert ReplyCodec.decode(client.request(server.endpoint, good)).hit_tokens == 32
    finally:
        server.close()
    lines = [r for r in caplog.records if "undecodable" in r.getMessage() or "refused a request" in r.getMessage()]
    assert len(lines) <= 2  # one line per 10 s interval (maybe spent by an earlier test), not 2,000
    assert not any(r.exc_info for r in caplog.records)  # no tracebacks
    assert threading.active_count() <= threads_before
