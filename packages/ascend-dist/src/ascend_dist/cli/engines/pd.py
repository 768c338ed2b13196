"""A disaggregated-prefill proxy over two `Engine`s, as a router in front of vLLM would run it.

Runs in: the caller's process. Pull (`disaggregated_generate`): each prompt goes to P with
``max_tokens=1`` and ``{"do_remote_decode": true}``; the ``kv_transfer_params`` P returns go to D
with the prompt, and D continues from P's KV cache instead of recomputing it. Push
(`pushed_generate`, the layer-wise connector): D gets the prompt first and announces its blocks to
the proxy's `Metaserver`; P then prefills with that announcement and writes each layer into D.
"""

from __future__ import annotations

import http.server
import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ascend_dist.cli.engines.host import Engine, EngineError
from ascend_dist.cli.engines.wire import Completion, Generated, Prompt

__all__ = ["Disaggregated", "Metaserver", "disaggregated_generate", "pull_connector_config", "pushed_generate"]


@dataclass(frozen=True)
class Disaggregated:
    """One prompt through the pair: what P returned, what D generated, and D's batch time."""

    prefill: Completion
    decode: Completion
    decode_seconds: float


def disaggregated_generate(
    prefill: Engine, decode: Engine, prompts: Sequence[Sequence[int]], *, max_tokens: int = 8, timeout_s: float = 120.0
) -> list[Disaggregated]:
    """Run ``prompts`` through P then D, each side in one batch.

    Raises:
        EngineError: P returned no ``kv_transfer_params`` for a prompt, or an engine failed.
    """
    first = prefill.generate(
        [Prompt(token_ids=list(p), max_tokens=1, kv_transfer_params={"do_remote_decode": True}) for p in prompts],
        timeout_s,
    )
    for i, c in enumerate(first):
        if c.kv_transfer_params is None and c.finish_reason != "stop":
            raise EngineError(f"{prefill.name} returned no kv_transfer_params for prompt {i} ({c.error or 'no error'})")
    # A request P finished itself (its first token was a stop token) has nothing left for D.
    to_decode = [i for i, c in enumerate(first) if c.kv_transfer_params is not None]
    second = decode.generate_timed(
        [Prompt(token_ids=list(prompts[i]), max_tokens=max_tokens, kv_transfer_params=first[i].kv_transfer_params)
         for i in to_decode],
        timeout_s,
    )  # fmt: skip
    decoded = dict(zip(to_decode, second.completions, strict=True))
    return [Disaggregated(p, decoded.get(i, p), second.seconds) for i, p in enumerate(first)]


def pull_connector_config(
    connector: str,
    role: str,
    *,
    engine_id: str,
    kv_port: int,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` of one side of a kv-mooncake pair, on 127.0.0.1 over TCP.

    D recomputes what it could not load (``kv_load_failure_policy="recompute"``; vLLM 0.32 fails the
    request by default).
    """
    return {
        "kv_connector": connector,
        "kv_role": role,
        "engine_id": engine_id,
        "kv_port": kv_port,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "prefill": {"tp_size": prefill_tp},
            "decode": {"tp_size": decode_tp},
            "host": "127.0.0.1",
            "mooncake_protocol": "tcp",
            **(extra or {}),
        },
    }


class Metaserver:
    """The proxy's ``/v1/metaserver``: where a push-mode D announces its blocks for each request.

    A threaded HTTP server on 127.0.0.1; `wait` returns the announcement of a request id. Bodies over
    1 MiB or not a JSON object naming a string ``request_id`` are refused (400) and never stored.
    """

    _MAX_BODY = 1 << 20

    def __init__(self) -> None:
        """Start serving on a free loopback port."""
        self._announced: dict[str, dict[str, Any]] = {}
        self._cond = threading.Condition()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= owner._MAX_BODY:
                    self.send_error(400, "body missing or over 1 MiB")
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError:
                    self.send_error(400, "not JSON")
                    return
                if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
                    self.send_error(400, "expected an object with a string request_id")
                    return
                with owner._cond:
                    owner._announced[body["request_id"]] = body
                    owner._cond.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # quiet: the tests read their own logs
                return

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metaserver", daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1/metaserver"

    def wait(self, request_id: str, timeout_s: float) -> dict[str, Any]:
        """D's announcement for ``request_id``.

        Raises:
            EngineError: None arrived within ``timeout_s``.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: request_id in self._announced, timeout_s):
                raise EngineError(f"D announced nothing for {request_id} within {timeout_s} s")
            return self._announced.pop(request_id)

    def close(self) -> None:
        """Stop serving and join the server thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def pushed_generate(
    prefill: Engine,
    decode: Engine,
    prompts: Sequence[Sequence[int]],
    metaserver: Metaserver,
    *,
    max_tokens: int = 8,
    timeout_s: float = 120.0,
) -> list[Disaggregated]:
    """Run ``prompts`` through a push-mode pair (layer-wise): D first, then P with D's announcement.

    D's batch runs on a helper thread (it finishes only once P has pushed); P gets each prompt with the
    params D posted to the metaserver plus ``do_remote_decode``.

    Raises:
        EngineError: D announced nothing, or an engine failed or missed the deadline.
    """
    tag = uuid.uuid4().hex[:8]
    ids = [f"pd-{tag}-{i}" for i in range(len(prompts))]
    to_decode = [
        Prompt(
            token_ids=list(p),
            max_tokens=max_tokens,
            kv_transfer_params={"do_remote_prefill": True, "metaserver": metaserver.url},
            request_id=rid,
        )
        for p, rid in zip(prompts, ids, strict=True)
    ]
    result: dict[str, Generated | BaseException] = {}

    def run_decode() -> None:
        try:
            result["d"] = decode.generate_timed(to_decode, timeout_s)
        except BaseException as exc:  # handed to the caller's thread below
            result["d"] = exc

    thread = threading.Thread(target=run_decode, name=f"decode-{decode.name}")
    thread.start()
    try:
        announced = [metaserver.wait(rid, timeout_s) for rid in ids]
        first = prefill.generate(
            [
                Prompt(
                    token_ids=list(p), max_tokens=1, kv_transfer_params={**a, "do_remote_decode": True}, request_id=rid
                )
                for p, a, rid in zip(prompts, announced, ids, strict=True)
            ],
            timeout_s,
        )
    finally:
        thread.join(timeout_s)
    if thread.is_alive():
        decode.kill()
        raise EngineError(f"{decode.name} did not finish within {timeout_s} s")
    second = result["d"]
    if isinstance(second, BaseException):
        raise second
    return [Disaggregated(p, d, second.seconds) for p, d in zip(first, second.completions, strict=True)]
