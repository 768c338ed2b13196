"""The demo's disaggregated-prefill proxy in front of two ``vllm serve`` instances (P and D).

    python -m ascend_dist.cli.engines.serve_proxy --prefill http://127.0.0.1:P --decode http://127.0.0.1:D --port N

Runs in: its own process (only the standard library). Demo code, not a product: one P, one D, no
streaming, no load balancing. Each ``POST /v1/completions`` goes to P with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true, ...}``; the ``kv_transfer_params`` P returns go to D
with the client's original request, as vllm-ascend's load-balance proxy and vLLM's toy proxy do
(both send the same ``X-Request-Id`` to P and D). D's answer is the client's answer. A P answer
without ``kv_transfer_params`` is an error (502), never a silent recompute on D.
"""

from __future__ import annotations

import argparse
import http.client
import http.server
import json
import sys
import urllib.parse
import uuid
from typing import Any

__all__ = ["ProxyError", "decode_request", "main", "prefill_request", "serve"]

MAX_BODY = 1 << 20
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "*"})


class ProxyError(Exception):
    """A request the proxy refuses (``status`` 400) or an upstream that failed (502 / 504)."""

    def __init__(self, status: int, message: str) -> None:
        """An HTTP status and the message the client gets."""
        super().__init__(message)
        self.status = status


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """What P gets: the client's request, one token, no streaming, and ``do_remote_decode``.

    Raises:
        ProxyError: The request asks for streaming (this proxy does not stream).
    """
    if body.get("stream"):
        raise ProxyError(400, "stream: true is not supported by this demo proxy")
    request = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "max_completion_tokens")}
    request.update(
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    return request


def decode_request(body: dict[str, Any], prefill_answer: object) -> dict[str, Any]:
    """What D gets: the client's request with the ``kv_transfer_params`` of P's answer.

    Raises:
        ProxyError: P's answer is not a JSON object carrying a ``kv_transfer_params`` object (502).
    """
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) else None
    if not isinstance(params, dict):
        raise ProxyError(502, f"P returned no kv_transfer_params (answer: {json.dumps(prefill_answer)[:300]})")
    return {**body, "kv_transfer_params": params}


def _post(base: str, path: str, payload: dict[str, Any], request_id: str, timeout_s: float) -> tuple[int, bytes]:
    url = urllib.parse.urlsplit(base)
    if url.scheme != "http" or not url.hostname or url.port is None:
        raise ProxyError(500, f"upstream {base!r} is not http://HOST:PORT")
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)  # no proxy variables: direct
    try:
        data = json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        conn.request("POST", path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, response.read(16 * MAX_BODY)
    except TimeoutError as exc:
        raise ProxyError(504, f"{base}{path} did not answer within {timeout_s} s") from exc
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, or a garbled answer
        raise ProxyError(502, f"{base}{path}: {exc!r}") from exc
    finally:
        conn.close()


def _forward(prefill: str, decode: str, path: str, body: dict[str, Any], timeout_s: float) -> tuple[int, bytes]:
    request_id = f"proxy-{uuid.uuid4().hex}"
    status, raw = _post(prefill, path, prefill_request(body), request_id, timeout_s)
    if status != 200:
        raise ProxyError(502, f"P answered {status}: {raw[:300].decode(errors='replace')}")
    try:
        answer = json.loads(raw)
    except ValueError as exc:
        raise ProxyError(502, "P's answer is not JSON") from exc
    return _post(decode, path, decode_request(body, answer), request_id, timeout_s)


def serve(host: str, port: int, prefill: str, decode: str, timeout_s: float) -> http.server.ThreadingHTTPServer:
    """The proxy's server, bound to ``host:port`` (not yet serving; call ``serve_forever``).

    Raises:
        ProxyError: ``host`` is a wildcard address.
    """
    if host in _WILDCARDS:
        raise ProxyError(400, f"refusing to bind the wildcard address {host!r}: name one interface")

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._reply(200, b"{}")
            else:
                self._reply(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            try:
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    raise ProxyError(404, f"no route {self.path}")
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY:
                    raise ProxyError(400, "body missing or over 1 MiB")
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError as exc:
                    raise ProxyError(400, "body is not JSON") from exc
                if not isinstance(body, dict):
                    raise ProxyError(400, "body is not a JSON object")
                status, data = _forward(prefill, decode, self.path, body, timeout_s)
            except ProxyError as exc:
                status, data = exc.status, json.dumps({"error": str(exc)}).encode()
            self._reply(status, data)

        def log_message(self, format: str, *args: Any) -> None:  # one line per request, to stderr
            sys.stderr.write(f"proxy: {self.address_string()} {format % args}\n")

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and serve until killed."""
    parser = argparse.ArgumentParser(description="Demo P/D proxy: P with max_tokens=1, then D with P's params.")
    parser.add_argument("--prefill", required=True, help="P's base URL, http://HOST:PORT")
    parser.add_argument("--decode", required=True, help="D's base URL, http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (never a wildcard)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each upstream call, seconds")
    args = parser.parse_args(argv)
    try:
        server = serve(args.host, args.port, args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout)
    except ProxyError as exc:
        print(f"proxy: {exc}", file=sys.stderr)
        return 2
    print(f"proxy: serving on http://{args.host}:{server.server_address[1]}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
