"""Fixtures of the SFA tests: a real P child process and a real D instance in the test process.

Both run the connector's scheduler and worker code over Mooncake's TCP transport on 127.0.0.1 and
the ZMQ side channel on free ports. One P child serves the module's tests where possible; every
child is stopped even when a test fails.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")

# --import-mode=importlib does not put this folder on sys.path; the vLLM tests import sfa_vllm_support from it.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.sfa_peer_process import SfaP, SfaPeer
from ascend_dist.kv_mooncake._demo.sfa_synthetic import SfaDInstance, SfaModel
from ascend_dist.kv_mooncake.core.engine import Reader, get_engine
from ascend_dist.kv_mooncake.pull.config import Role
from ascend_dist.kv_mooncake.sfa.config import SfaConfig

_IDS = itertools.count()


@dataclass
class SfaPair:
    """A P instance in a child process and a D instance here."""

    p: SfaP
    d: SfaDInstance
    extra: dict[str, Any]

    def run(self, rid: str, prompt_len: int, seed: int, *, computed: int = 0, chunk: int = 0) -> dict[str, Any]:
        """D allocates and posts its contact; the 'proxy' hands it to P, which prefills."""
        params = self.d.decode(rid, prompt_len, computed)
        self.p.prefill([{"rid": f"p-{rid}", "prompt_len": prompt_len, "seed": seed, "params": params, "chunk": chunk}])
        return params


def d_config(extra: dict[str, Any], engine_id: str) -> SfaConfig:
    """D's config for the shared settings."""
    return SfaConfig.from_kv_transfer_config(
        engine_id=engine_id,
        kv_role=Role.CONSUMER.value,
        kv_port=extra["kv_port"],
        extra=extra,
        model=str(extra.get("model", "synthetic-sfa")),
        dtype="int16",
    )


@pytest.fixture(scope="session")
def sfa_peer() -> Iterator[SfaPeer]:
    """The shared P child process (starting Python with torch costs seconds on a loaded machine)."""
    with SfaPeer() as peer:
        yield peer


@pytest.fixture
def make_sfa_pair(sfa_peer: SfaPeer) -> Iterator[Callable[..., SfaPair]]:
    """Build P/D pairs: ``p_tp``, ``d_tp``, ``p_extra``/``d_extra`` overrides, model fields.

    ``own_process=True`` gives P its own child (for tests that kill it), ``p_rpc_ports`` too, its
    Mooncake ports drawn from that range; ``d_reader`` wraps D's engine (a fault injected at D's reads).
    """
    made: list[SfaPair] = []
    peers: list[SfaPeer] = []

    def build(
        p_tp: int = 1,
        d_tp: int = 1,
        *,
        p_extra: dict[str, Any] | None = None,
        d_extra: dict[str, Any] | None = None,
        d_model: dict[str, Any] | None = None,
        d_reader: Callable[[Reader], Reader] | None = None,
        own_process: bool = False,
        p_rpc_ports: tuple[int, int] | None = None,
        **model: Any,
    ) -> SfaPair:
        n = next(_IDS)
        extra: dict[str, Any] = {
            "kv_port": free_port_range(d_tp),
            "prefill": {"tp_size": p_tp},
            "decode": {"tp_size": d_tp},
            "transfer_backend": "mooncake",
            "read_timeout_s": 5.0,
            "hello_timeout_s": 2.0,
            "quarantine_s": 0.05,
            "recv_timeout_s": 20.0,
            "dest_wait_s": 0.5,
        }
        spec = {"layers": 3, "block_size": 8, "num_blocks": 48, "main_dims": (32, 8), "indexer_dims": (8,), **model}
        peer = sfa_peer
        if own_process or p_rpc_ports:
            peer = SfaPeer(rpc_ports=p_rpc_ports)
            peers.append(peer)
        p = peer.create_p(f"p{n}", {**extra, "engine_id": f"P{n}", **(p_extra or {})}, spec)
        d_extra_all = {**extra, **(d_extra or {})}
        spec_d = {**spec, **(d_model or {})}
        spec_d = {**spec_d, **{k: tuple(v) for k, v in spec_d.items() if k.endswith("_dims")}}
        engine: Reader = get_engine("127.0.0.1")
        d = SfaDInstance(d_config(d_extra_all, f"D{n}"), SfaModel(**spec_d), d_reader(engine) if d_reader else engine)
        pair = SfaPair(p, d, extra)
        made.append(pair)
        return pair

    try:
        yield build
    finally:
        for pair in made:
            pair.d.shutdown()
            if pair.p.peer is sfa_peer:
                pair.p.drop()
        for peer in peers:
            peer.close()
