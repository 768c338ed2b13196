"""A child process holding a paged, split K/V cache registered with a Mooncake engine over TCP.

Protocol on stdin/stdout, one JSON object per line (never pickle): on start it prints
{"session", "bases", "regions"}; it then answers {"cmd": "quit"} by unregistering and exiting, and
exits by itself when stdin closes (the parent died), so it never outlives a test.
"""

from __future__ import annotations

import argparse
import json
import sys

from kv_cache import SplitKVCache
from mooncake.engine import TransferEngine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()

    cache = SplitKVCache(args.layers, args.blocks, args.block_bytes)
    cache.fill(args.seed)
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        print(json.dumps({"error": "initialize failed"}), flush=True)
        return 1
    regions = cache.register(engine)
    hello = {"session": f"127.0.0.1:{engine.get_rpc_port()}", "bases": cache.bases(), "regions": len(regions.ptrs)}
    print(json.dumps(hello), flush=True)
    for line in sys.stdin:
        if json.loads(line).get("cmd") == "quit":
            break
    cache.unregister(engine, regions)
    return 0


if __name__ == "__main__":
    sys.exit(main())
