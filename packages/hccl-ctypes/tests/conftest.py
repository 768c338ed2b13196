"""Fixtures of the hccl-ctypes tests: the fake HCCL library (compiled here) and a multi-rank runner."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.testing.ports import free_port

HERE = Path(__file__).parent
WORKER = HERE / "workers" / "rank_worker.py"
C_SOURCE = HERE / "csrc" / "fake_hccl.c"

RunRanks = Callable[..., list[dict[str, Any]]]
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `vllm`-marked tests where the pinned vLLM is not installed (run them in .nox/vllm)."""
    del config
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="needs the pinned vllm: .nox/vllm/bin/python -m pytest -m vllm")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


def _compile(source: Path, out_dir: Path, name: str) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler (cc) on PATH: the ABI conformance libraries cannot be built")
    out = out_dir / name
    subprocess.run(
        [cc, "-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(out), str(source), "-lpthread", "-lrt"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(out)


@pytest.fixture(scope="session")
def fake_hccl(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Compile csrc/fake_hccl.c (HCCL ABI, shared memory, 1-8 ranks) with the system cc; its .so path."""
    return _compile(C_SOURCE, tmp_path_factory.mktemp("fakehccl"), "libfakehccl.so")


@pytest.fixture(scope="session")
def fake_nccl(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Compile csrc/fake_nccl.c (NCCL ABI, one rank) with the system cc; its .so path."""
    return _compile(HERE / "csrc" / "fake_nccl.c", tmp_path_factory.mktemp("fakenccl"), "libfakenccl.so")


def _kill(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)


@pytest.fixture
def run_ranks() -> RunRanks:
    """Run `workers/rank_worker.py SCENARIO` as ``world`` processes; return each rank's RESULT dict."""

    def run(
        scenario: str, world: int, env: dict[str, str] | None = None, timeout: float = 45.0
    ) -> list[dict[str, Any]]:
        port = free_port()
        full_env = {**os.environ, "ASCEND_DIST_DEVICE": "cpu", **(env or {})}
        procs: list[subprocess.Popen[str]] = []
        try:
            for rank in range(world):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), scenario, str(rank), str(world), str(port)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        text=True,
                        env=full_env,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout
            results = []
            for rank, p in enumerate(procs):
                out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
                lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
                if p.returncode != 0 or not lines:
                    raise AssertionError(f"rank {rank} exited {p.returncode}:\n{out}\n{err[-3000:]}")
                results.append(json.loads(lines[-1].removeprefix("RESULT ")))
            return results
        finally:
            _kill(procs)

    return run
