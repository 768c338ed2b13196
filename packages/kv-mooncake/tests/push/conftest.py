"""Fixtures: layer-wise P ranks in child processes, D in the test process, real Mooncake TCP + ZMQ.

D's scheduler announces each request to an in-process metaserver (`CollectingMetaserver`, a fake
of the package's own `Metaserver` Protocol); the test plays the proxy and hands the params to every
P rank. Each P rank runs the layer-by-layer forward and pushes into D's blocks. P processes that
need a gloo group (P_tp > D_tp) are started per test; every child is stopped even on failure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")

# --import-mode=importlib does not put this folder on sys.path; the vLLM tests import push_vllm_support from it.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.push_peer import LwPeerProcess
from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver, LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig

_IDS = itertools.count()


@dataclass
class LwPair:
    """P ranks (children), a D instance here, and the in-process metaserver."""

    peers: list[LwPeerProcess]
    name: str
    d: LwInstance
    metaserver: CollectingMetaserver
    extra: dict[str, Any]
    spec: dict[str, Any]
    own: list[LwPeerProcess] = field(default_factory=list)

    def send_prefill(self, params: dict[str, Any], prompt_len: int, seed: int, **kw: Any) -> None:
        for peer in self.peers:
            peer.send(
                {"cmd": "prefill", "name": self.name, "params": params, "prompt_len": prompt_len, "seed": seed, **kw}
            )

    def read_prefill(self, timeout_s: float = 30.0) -> list[float]:
        out = []
        for peer in self.peers:
            reply = peer.read(timeout_s)
            assert "error" not in reply, reply
            out.append(float(reply["elapsed"]))
        return out

    def transfer(self, rid: str, prompt_len: int, seed: int, computed: int = 0, **kw: Any) -> set[int]:
        """Announce on D, prefill on every P rank, wait on D; return D's load errors."""
        self.d.announce(rid, prompt_len, computed_tokens=computed)
        params = self.metaserver.take(rid)
        self.send_prefill(params, prompt_len, seed, **kw)
        self.read_prefill()
        return self.d.wait_recv({rid}, timeout_s=20.0)

    def p_idle(self) -> list[int]:
        return [int(p.call({"cmd": "idle", "name": self.name})["blocks_lent"]) for p in self.peers]


@pytest.fixture(scope="session")
def p_single() -> Iterator[LwPeerProcess]:
    """A shared P child hosting single-process P instances (no gloo)."""
    with LwPeerProcess() as peer:
        yield peer


@pytest.fixture
def make_lw_pair(p_single: LwPeerProcess) -> Iterator[Callable[..., LwPair]]:
    """Build P/D pairs. ``p_procs=True`` puts each P rank in its own child (gloo when resharding).

    ``p_model`` overrides model fields on P only (for example another KV layout).
    """
    made: list[LwPair] = []

    def build(
        p_tp: int = 1,
        d_tp: int = 1,
        *,
        p_procs: bool = False,
        d_extra: dict[str, Any] | None = None,
        p_extra: dict[str, Any] | None = None,
        fail_announce: str = "",
        p_model: dict[str, Any] | None = None,
        **model: Any,
    ) -> LwPair:
        n = next(_IDS)
        kv_port = free_port_range(d_tp)
        extra = {
            "engine_id": f"LP{n}",
            "kv_port": kv_port,
            "prefill": {"tp_size": p_tp},
            "decode": {"tp_size": d_tp},
            "rpc_timeout_s": 0.5,
            "rpc_retries": 2,
        }
        spec = {"layers": 4, "heads": 4, "head_dim": 16, "block_size": 16, "num_blocks": 32, **model}
        d_cfg = LayerwiseConfig.from_kv_transfer_config(
            engine_id=f"LD{n}",
            kv_role="kv_consumer",
            kv_port=kv_port,
            extra={**extra, **(d_extra or {})},
            model="synthetic",
            dtype="int16",
        )
        ms = CollectingMetaserver(fail_with=fail_announce)
        d = LwInstance(d_cfg, Model(**spec), metaserver=ms)
        name = f"lp{n}"
        peers: list[LwPeerProcess] = []
        own: list[LwPeerProcess] = []
        pair = LwPair(peers, name, d, ms, extra, spec, own)
        made.append(pair)
        p_cfg = {**extra, **(p_extra or {})}
        p_spec = {**spec, **(p_model or {})}  # model fields that differ on P only
        if not p_procs:
            p_single.call({"cmd": "create", "name": name, "config": p_cfg, "model": p_spec}, timeout_s=60.0)
            peers.append(p_single)
            return pair
        init = f"file://{tempfile.mkdtemp(prefix='lw-gloo-')}/pg"
        reshard = p_tp > d_tp and not spec.get("mla")
        own.extend(LwPeerProcess() for _ in range(p_tp))
        for rank, peer in enumerate(own):
            gloo = {"init_method": init, "rank": rank, "world_size": p_tp, "timeout_s": 30.0} if reshard else None
            peer.send(
                {"cmd": "create", "name": name, "config": p_cfg, "model": p_spec, "tp_ranks": [rank], "gloo": gloo}
            )
        for peer in own:
            reply = peer.read(60.0)
            assert "error" not in reply, reply
            peers.append(peer)
        return pair

    yield build
    for pair in made:
        try:
            pair.d.shutdown()
        finally:
            for peer in pair.own:
                peer.close()
            if not pair.own and p_single.proc.poll() is None:
                with contextlib.suppress(Exception):  # the shared child may hold no such instance
                    p_single.call({"cmd": "drop", "name": pair.name}, timeout_s=30.0)
