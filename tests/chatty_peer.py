"""A JsonPeer child that logs more to stderr than a pipe holds before it answers (for test_peers.py)."""

from __future__ import annotations

import json
import sys

for line in sys.stdin:
    message = json.loads(line)
    if message.get("cmd") == "quit":
        break
    for _ in range(256):  # 256 KiB: four times the default pipe buffer
        sys.stderr.write("x" * 1023 + "\n")
    sys.stderr.flush()
    print(json.dumps({"ok": True, "echo": message.get("n")}), flush=True)
