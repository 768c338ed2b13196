"""Hostile ``kv_transfer_params`` and a driver of vLLM's real v1 Scheduler, for the connectors' tests.

The garbage tables are plain data. `Engine` imports vLLM only when built and `Metaserver` is the
standard library's HTTP server, so importing this module costs nothing without vLLM.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import pytest

from ascend_dist.testing import vllm_builders


class Garbage(NamedTuple):
    """One hostile variant of a good ``kv_transfer_params`` dict.

    Attributes:
        name: Test id.
        make: Good params -> the hostile value (need not be a dict).
        key: What the single warning must name.
    """

    name: str
    make: Callable[[dict[str, Any]], Any]
    key: str


def with_(**changes: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Good params with ``changes`` applied."""
    return lambda good: {**good, **changes}


def without(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Good params without ``key``."""
    return lambda good: {k: v for k, v in good.items() if k != key}


NOT_A_DICT: list[Garbage] = [
    Garbage("not-a-dict", lambda good: "abc", "kv_transfer_params"),
    Garbage("a-list", lambda good: [1, 2, 3], "kv_transfer_params"),
]
"""Params that are not a dict at all (``vllm_xargs`` can carry any JSON value)."""

ENDPOINT: list[Garbage] = [
    Garbage("port-abc", with_(remote_port="abc"), "remote_port"),
    Garbage("port-zero", with_(remote_port=0), "remote_port"),
    Garbage("port-float", with_(remote_port=float("inf")), "remote_port"),
    Garbage("host-huge", with_(remote_host="h" * 100_000), "remote_host"),
    Garbage("host-endpoint", with_(remote_host="127.0.0.1:5555;evil"), "remote_host"),
    Garbage("host-missing", without("remote_host"), "remote_host"),
]
"""A peer's address that is malformed, missing or hostile."""

BLOCK_IDS: list[Garbage] = [
    Garbage("ids-not-a-list", with_(remote_block_ids="1,2,3"), "remote_block_ids"),
    Garbage("ids-negative", with_(remote_block_ids=[[-1, 4, 5]]), "remote_block_ids"),
    Garbage("ids-huge", with_(remote_block_ids=[[2**40, 4, 5]]), "remote_block_ids"),
    Garbage("ids-bool", with_(remote_block_ids=[[True, 4, 5]]), "remote_block_ids"),
    Garbage("ids-nan", with_(remote_block_ids=[[float("nan"), 4, 5]]), "remote_block_ids"),
    Garbage("ids-too-many", with_(remote_block_ids=[list(range(40))]), "remote_block_ids"),
    Garbage("ids-groups", with_(remote_block_ids=[[4], [5], [6]]), "remote_block_ids"),
]
"""Absurd block ids (for a 40-token prompt of 16-token blocks and one KV-cache group)."""

METASERVER: list[Garbage] = [
    Garbage("metaserver-missing", without("metaserver"), "metaserver"),
    Garbage("metaserver-file", with_(metaserver="file:///etc/passwd"), "metaserver"),
    Garbage("metaserver-int", with_(metaserver=80), "metaserver"),
    Garbage("metaserver-huge", with_(metaserver="http://x/" + "a" * 100_000), "metaserver"),
]
"""A D's metaserver URL (where its scheduler POSTs) that is missing or not http(s)."""


def flag(name: str) -> list[Garbage]:
    """A flag that is not a JSON boolean (``"false"`` is truthy) and one that is a number."""
    return [Garbage(f"{name}-string", with_(**{name: "yes"}), name), Garbage(f"{name}-int", with_(**{name: 1}), name)]


def ascend_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Messages of WARNING or above logged by this project's loggers.

    The process's one start-up notice that peers are unauthenticated (`warn_unauthenticated`, logged
    by whichever connector the test builds first) is not about any request and is left out.
    """
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("ascend_dist") and r.name != "ascend_dist.common.secret"
    ]


def assert_one_warning(caplog: pytest.LogCaptureFixture, key: str, rid: str = "bad") -> None:
    """Exactly one warning, naming the request, ``key`` and short enough (the value is repr-truncated)."""
    messages = ascend_warnings(caplog)
    assert len(messages) == 1, messages
    assert key in messages[0] and rid in messages[0], messages[0]
    assert len(messages[0]) < 1000, len(messages[0])


class Engine:
    """vLLM's real v1 Scheduler (its scheduler-role connector built by vLLM), driven without a model."""

    def __init__(self, config: Any, kcc: Any, block: int) -> None:
        """Build the Scheduler for ``config`` and ``kcc`` (blocks of ``block`` tokens)."""
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.sched = Scheduler(
            vllm_config=config,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block,
            log_stats=False,
        )
        self.free_at_start = self.free_blocks()
        self.params: dict[str, dict[str, Any] | None] = {}

    @property
    def connector(self) -> Any:
        """The scheduler-role connector vLLM built."""
        return self.sched.connector

    def add(self, rid: str, tokens: int, params: Any, *, first: int = 100) -> Any:
        """Add a request (prompt ``first..first+tokens``, one output token) carrying ``params``, as vLLM hashes it."""
        hasher = vllm_builders.block_hasher(self.sched.vllm_config, self.sched.kv_cache_config)
        req = vllm_builders.request(rid, tokens, params, first=first, hasher=hasher)
        self.sched.add_request(req)
        return req

    def schedule(self) -> Any:
        """One scheduler step."""
        return self.sched.schedule()

    def step(
        self,
        out: Any,
        *,
        sampled: Iterable[str] = (),
        recving: Iterable[str] = (),
        sending: Iterable[str] = (),
        failed: Iterable[str] = (),
        invalid: Iterable[int] = (),
    ) -> None:
        """Feed the model runner's output for ``out``: one token per ``sampled`` id and the connector's report.

        The kv_transfer_params of requests that finish are kept in `params`.
        """
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        ids = list(sampled)
        report = KVConnectorOutput(
            finished_sending=set(sending) or None,
            finished_recving=set(recving) or None,
            failed_recving=set(failed),
            invalid_block_ids=set(invalid),
        )
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=report,
        )
        for outputs in self.sched.update_from_output(out, runner).values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.params[o.request_id] = o.kv_transfer_params

    def free_blocks(self) -> int:
        """Blocks of the pool that no request holds."""
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def assert_idle(self, tracked: Callable[[], int]) -> None:
        """Nothing left: no request, every block back, ``tracked()`` (the connector's state) 0."""
        self.step(self.schedule())  # one more step: delayed frees and the connector's last metadata
        assert not self.sched.requests
        assert self.free_blocks() == self.free_at_start
        assert tracked() == 0

    def close(self) -> None:
        """Shut the Scheduler (and its connector) down."""
        self.sched.shutdown()


class Metaserver:
    """The proxy's metaserver endpoint on 127.0.0.1: keeps every body D's scheduler POSTs, by request id."""

    def __init__(self) -> None:
        """Start serving on a free port."""
        self.got: dict[str, dict[str, Any]] = {}
        got = self.got

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                got[str(body.get("request_id"))] = body
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"

    def wait_for(self, ids: Iterable[str], timeout_s: float = 10.0) -> None:
        """Until a body for each id arrived."""
        deadline = time.monotonic() + timeout_s
        while not set(ids) <= set(self.got):
            assert time.monotonic() < deadline, f"posted only {sorted(self.got)}"
            time.sleep(0.01)

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
