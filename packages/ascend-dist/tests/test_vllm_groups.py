"""Ascend groups created through the pinned vLLM's real GroupCoordinator, 2 processes over gloo."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# Fresh processes each import vLLM (~15 s alone, far more on a loaded 2-core machine).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]
WORKER = Path(__file__).with_name("vllm_groups_worker.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_groups_through_vllm_init_model_parallel_group():
    port, world = _free_port(), 2
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    seen = sorted((json.loads(out.strip().splitlines()[-1]) for out, _ in outputs), key=lambda s: s["rank"])
    for rank, s in enumerate(seen):
        assert s == {"rank": rank, "mc2_size": 2, "p_tp_ranks": [0, 1], "sum": 1.0, "global_rank": rank,
                     "destroyed": True}  # fmt: skip
