"""Fixtures: real P instances in one child process and real D instances in the test process.

Both run the package's scheduler and worker code over Mooncake's TCP transport on 127.0.0.1 and
the ZMQ side channel on free ports. One P child serves the whole session (starting Python with
torch costs seconds on a loaded 2-core machine); tests that kill P start their own. Every child is
stopped even when a test fails.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")
# Single-host tests: a config without ``host`` takes this node's address (`core.node`); pin it to
# loopback here (the tests' ports are free on 127.0.0.1, and nothing is exposed on the network).
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

# --import-mode=importlib does not put this folder on sys.path; the vLLM tests import pull_vllm_support
# from it (push/ and sfa/ add their own folders: helper names differ so they cannot shadow each other).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess, PInstance, free_port_range
from ascend_dist.kv_mooncake._demo.synthetic import Model, SyntheticInstance
from ascend_dist.kv_mooncake.pull.config import PullConfig

_IDS = itertools.count()


@dataclass
class Pair:
    """A P instance (child process), a D instance here, and their shared settings."""

    p: PInstance
    d: SyntheticInstance
    extra: dict[str, Any]
    kv_port: int

    def transfer(self, rid: str, prompt_len: int, seed: int, computed: int = 0, timeout_s: float = 15.0) -> set[int]:
        """Prefill on P, pull on D, wait; return D's load errors."""
        params = self.p.prefill(rid, prompt_len, seed)
        self.d.decode(rid, prompt_len, params, computed_tokens=computed)
        return self.d.wait_recv({rid}, timeout_s)

    def wait_p_idle(self, polls: int = 300) -> dict[str, Any]:
        """Poll P until every lent block came back (or ``polls`` polls 10 ms apart)."""
        reply: dict[str, Any] = {}
        for _ in range(polls):
            reply = self.p.poll()
            if reply["blocks_lent"] == 0:
                break
            time.sleep(0.01)
        return reply


@pytest.fixture(scope="session")
def p_server() -> Iterator[PeerProcess]:
    """The shared P child process."""
    with PeerProcess() as peer:
        yield peer


@pytest.fixture
def make_pair(p_server: PeerProcess) -> Iterator[Callable[..., Pair]]:
    """Build P/D pairs; pass ``own_process=True`` for a P that the test may kill.

    ``p_cp`` / ``d_cp`` are ``(pcp_size, dcp_size)`` of P and D; ``p_model`` overrides model
    fields on P only (for example a larger logical block); ``rpc_ports`` pins the Mooncake RPC
    port of an ``own_process`` P (first, last).
    """
    made: list[tuple[Pair, PeerProcess | None]] = []

    def build(
        p_tp: int = 1,
        d_tp: int = 1,
        p_pp: int = 1,
        *,
        d_extra: dict[str, Any] | None = None,
        own_process: bool = False,
        d_engine: Any = None,
        p_cp: tuple[int, int] = (1, 1),
        d_cp: tuple[int, int] = (1, 1),
        p_model: dict[str, Any] | None = None,
        rpc_ports: tuple[int, int] | None = None,
        **model: Any,
    ) -> Pair:
        n = next(_IDS)
        kv_port = free_port_range(p_tp * p_pp * p_cp[0])
        extra = {
            "engine_id": f"P{n}",
            "kv_port": kv_port,
            "prefill": {"tp_size": p_tp, "pp_size": p_pp, "pcp_size": p_cp[0], "dcp_size": p_cp[1]},
            "decode": {"tp_size": d_tp, "pcp_size": d_cp[0], "dcp_size": d_cp[1]},
            "rpc_timeout_s": 0.5,
            "lease_s": float(model.pop("lease_s", 30.0)),
            **{k: model.pop(k) for k in ("pull_timeout_s", "max_message_bytes") if k in model},
        }
        spec = {"layers": 4, "heads": 4, "head_dim": 16, "block_size": 16, "num_blocks": 32, **model}
        peer = PeerProcess(rpc_ports=rpc_ports) if own_process else None
        try:
            p = (peer or p_server).create(f"p{n}", extra, {**spec, **(p_model or {})})
            d_cfg = {**extra, **(d_extra or {})}
            cfg = PullConfig.from_kv_transfer_config(
                engine_id=f"D{n}",
                kv_role="kv_consumer",
                kv_port=kv_port,
                extra=d_cfg,
                model=str(d_cfg.get("model", "synthetic")),
                dtype="int16",
            )
            p_block = int((p_model or {}).get("block_size", 0))
            d = SyntheticInstance(cfg, Model(**spec), engine=d_engine, p_block_size=p_block)
            pair = Pair(p, d, extra, kv_port)
        except BaseException:
            if peer is not None:
                peer.close()
            raise
        made.append((pair, peer))
        return pair

    yield build
    for pair, peer in made:
        try:
            pair.d.shutdown()
            if peer is None:
                pair.p.drop()
        finally:
            if peer is not None:
                peer.close()
