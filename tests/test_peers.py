"""The JsonPeer harness itself: a child's stderr never blocks it, and its tail is there for errors."""

from __future__ import annotations

from peers import JsonPeer


def test_a_child_logging_more_than_a_pipe_holds_still_answers() -> None:
    peer = JsonPeer("chatty_peer.py")
    try:
        for n in range(3):  # with stderr on an unread pipe the first answer never came
            peer.send({"cmd": "echo", "n": n})
            assert peer.read(timeout=10.0) == {"ok": True, "echo": n}
        assert peer.stderr_tail().endswith("x\n")  # readable while the child runs
    finally:
        assert peer.close() == 0
