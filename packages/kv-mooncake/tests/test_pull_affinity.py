"""Transfer threads leave the forward thread's core (the ``vllm serve`` pull timeouts of issue 26).

vLLM's CPU worker binds its forward thread to its OpenMP core before the connector registers, and
every thread started from it inherits that. Under ``vllm serve`` both P's and D's forward threads
spin on that core while a pull is pending, so D's pull threads, P's side channel and both Mooncake
engines' threads waited behind them: pulls ran past a minute and D recomputed every request. The
child (`affinity_child.py`) binds its main thread the same way, registers a real P and D (Mooncake
TCP, ZMQ side channel) and pulls one request; every thread that started meanwhile must run off the
forward core, the forward thread must keep its binding, and the pulled bytes must be P's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range

pytestmark = [
    pytest.mark.mooncake,
    pytest.mark.skipif(
        not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
        reason="needs Linux CPU affinity and two CPUs to leave one",
    ),
]


def test_pull_threads_run_off_the_forward_threads_core() -> None:
    child = Path(__file__).with_name("affinity_child.py")
    done = subprocess.run(
        [sys.executable, str(child), str(free_port_range(1))], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    forward, allowed = report["forward"], set(report["allowed"])
    assert report["main_after"] == [forward]  # vLLM's binding of its forward thread is left alone
    assert report["errors"] == [] and report["checked"] > 0  # the control: the pull moved P's bytes
    started = report["started"]
    # The engine's, the side channel's (ZMQ I/O included) and the pull pool's threads.
    assert len(started) >= 4, started
    stuck = [(name, cpus) for name, cpus in started if cpus == [forward]]
    assert not stuck, f"threads confined to the forward core {forward}: {stuck}"
    assert all(set(cpus) == allowed - {forward} for _, cpus in started), started
