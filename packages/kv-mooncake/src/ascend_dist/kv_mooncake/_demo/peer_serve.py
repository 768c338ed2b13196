"""The child side of a peer process: named P instances served over JSON lines (never pickle).

Runs in: the child processes of `pd_peer`, `layerwise.peer` and `sfa.peer` (driven by
`peer_process.PeerProcess`). `serve` prints ``{"ready": true}``, then answers one JSON line per
command line read from stdin:

* ``{"cmd": "create", "name", ...}`` -> ``{"ok": true}`` (the module's ``create`` builds the instance)
* ``{"cmd": "drop", "name"}`` -> ``{"ok": true}`` (shuts that instance down)
* ``{"cmd": <other>, "name", ...}`` -> the module's handler's reply
* ``{"cmd": "quit"}`` or end of input -> shuts every instance down and returns.

A failing command is answered ``{"error": "<Type>: <message>"}`` and the process keeps serving.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

__all__ = ["PeerInstance", "reply", "serve"]


class PeerInstance(Protocol):
    """What a served instance must offer: a shutdown releasing everything it holds."""

    def shutdown(self) -> None:
        """Stop the instance's threads and release its resources."""
        ...


InstanceT = TypeVar("InstanceT", bound=PeerInstance)

Handler = Callable[[InstanceT, dict[str, Any]], dict[str, Any]]


def reply(obj: dict[str, Any]) -> None:
    """Write one JSON line to stdout and flush it."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _handle(
    instances: dict[str, InstanceT],
    msg: dict[str, Any],
    create: Callable[[dict[str, Any]], InstanceT],
    commands: Mapping[str, Handler[InstanceT]],
) -> dict[str, Any]:
    cmd = msg.get("cmd")
    if cmd == "create":
        instances[str(msg["name"])] = create(msg)
        return {"ok": True}
    inst = instances.get(str(msg.get("name", "")))
    if inst is None:
        return {"error": f"unknown instance {msg.get('name')!r} for cmd {cmd!r}"}
    if cmd == "drop":
        instances.pop(str(msg["name"])).shutdown()
        return {"ok": True}
    handler = commands.get(str(cmd))
    return handler(inst, msg) if handler is not None else {"error": f"unknown cmd {cmd!r}"}


def serve(create: Callable[[dict[str, Any]], InstanceT], commands: Mapping[str, Handler[InstanceT]]) -> int:
    """Serve commands until ``quit`` or end of input; shut every instance down on the way out.

    Args:
        create: Builds an instance from a ``create`` message.
        commands: Handler of each other command, given the named instance and the message.

    Returns:
        The exit code (0).
    """
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    instances: dict[str, InstanceT] = {}
    reply({"ready": True})
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            if msg.get("cmd") == "quit":
                break
            try:
                reply(_handle(instances, msg, create, commands))
            except Exception as exc:  # a bad command is reported, the process keeps serving
                reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for inst in instances.values():
            inst.shutdown()
    return 0
