"""Run N ranks of a worker function as forked processes and collect their JSON results.

Runs in: the parent (the `ascend-dist` command or a test). Children are forked, so they start in
milliseconds with torch already imported; each reports one JSON document through a pipe as raw
bytes (no pickle). Every child is killed and joined when the parent returns, even on failure.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ascend_dist.common.errors import DeadlineExceeded, TransferError
from ascend_dist.common.timeouts import Deadline

__all__ = ["free_port", "run_ranks"]

Worker = Callable[[dict[str, Any]], dict[str, Any]]


def free_port(host: str = "127.0.0.1") -> int:
    """An OS-assigned free TCP port on `host`."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _child(worker: Worker, cfg: dict[str, Any], conn: Connection) -> None:
    try:
        result = worker(cfg)
    except BaseException as exc:  # report anything to the parent, then exit non-zero
        where = "".join(traceback.format_tb(exc.__traceback__, limit=-3))
        report = {"rank": cfg["rank"], "exception": f"{type(exc).__name__}: {exc}", "where": where}
        conn.send_bytes(json.dumps(report).encode())
        conn.close()
        os._exit(1)
    conn.send_bytes(json.dumps(result).encode())
    conn.close()
    os._exit(0)  # skip atexit hooks inherited from the parent


def run_ranks(worker: Worker, cfg: dict[str, Any], world: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Fork `world` ranks of `worker(cfg | {rank, world, port})`; results sorted by rank.

    Raises:
        DeadlineExceeded: a rank did not report within `timeout_s` (all ranks are killed).
        TransferError: a rank raised (its message is included).
    """
    # Collect the parent's garbage here, where its finalizers can run: a forked child inherits it, and a
    # finalizer that waits for one of the parent's threads (a gloo group's, a stream's) hangs the child.
    gc.collect()
    ctx = mp.get_context("fork")
    port = free_port()
    deadline = Deadline.after(timeout_s)
    procs: list[Any] = []
    conns: list[Connection] = []
    try:
        for rank in range(world):
            recv_end, send_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(worker, {**cfg, "rank": rank, "world": world, "port": port}, send_end)
            )
            proc.start()
            send_end.close()
            procs.append(proc)
            conns.append(recv_end)
        results = []
        for rank, conn in enumerate(conns):
            if not conn.poll(deadline.remaining()):
                raise DeadlineExceeded(f"rank {rank} did not report within {timeout_s} s")
            results.append(json.loads(conn.recv_bytes().decode()))
    finally:
        for proc in procs:
            proc.join(timeout=max(deadline.remaining(), 5.0) if proc.is_alive() else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in conns:
            conn.close()
    failed = [f"{r['exception']}\n{r['where']}" for r in results if "exception" in r]
    if failed:
        raise TransferError(f"{len(failed)} rank(s) failed: {failed}")
    return sorted(results, key=lambda r: r["rank"])
