"""Cost of the frame MAC: seal + check per frame, and an RPC round trip with and without a secret.

Not collected by pytest (the name does not start with ``test_``). Run:
    uv run --no-sync python packages/common/tests/wire/bench_frame_auth.py
"""

from __future__ import annotations

import statistics
import time

from ascend_dist.common.frame_auth import FrameAuth
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.zmq_rpc import RpcClient, RpcServer
from ascend_dist.common.zmq_server import KIND_REPLY, KIND_REQUEST, pack_header

SECRET = DeploymentSecret(bytes(range(32)))
SIZES = (256, 4096, 65536, 1 << 20)


def mac_cost_us(size: int, n: int) -> float:
    """Median microseconds to seal a request, check it, seal and check its reply (both ends' work)."""
    client, server = FrameAuth(SECRET), FrameAuth(SECRET, max_nonces=n + 1)
    header, payload, reply_header = pack_header(KIND_REQUEST, 1), b"x" * size, pack_header(KIND_REPLY, 1)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            auth = client.seal_request(header, payload)
            nonce = server.check_request(header, payload, auth)
            client.check_reply(nonce, reply_header, b"ok", server.seal_reply(nonce, reply_header, b"ok"))
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def rpc_round_trip_us(secret: DeploymentSecret | None, size: int, n: int) -> float:
    """Median microseconds of one request/reply over a real server on 127.0.0.1."""
    payload = b"x" * size
    with (
        RpcServer("127.0.0.1", 0, lambda p: b"ok", secret=secret) as server,
        RpcClient(timeout_s=5.0, retries=1, secret=secret) as client,
    ):
        for _ in range(50):
            client.request(server.endpoint, payload)
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n):
                client.request(server.endpoint, payload)
            samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples)


def main() -> None:
    print("size      | MAC work per frame | RPC round trip: no secret | with secret | overhead")
    for size in SIZES:
        n = 2000 if size <= 65536 else 200
        mac = mac_cost_us(size, n)
        plain = rpc_round_trip_us(None, size, n // 4)
        authed = rpc_round_trip_us(SECRET, size, n // 4)
        row = (f"{size} B", f"{mac:.1f} us", f"{plain:.1f} us", f"{authed:.1f} us", f"{authed - plain:+.1f} us")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
