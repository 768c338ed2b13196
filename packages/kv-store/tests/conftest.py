"""Fixtures: a real ``mooncake_master`` and a real openYuanrong worker on loopback, and CPU KV caches."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# --import-mode=importlib does not put this folder on sys.path; the soak imports pool_soak_support from it.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from ascend_dist.common.errors import StoreError
from ascend_dist.kv_store.master_process import MasterProcess
from ascend_dist.testing.ports import free_port, wait_port


def _unavailable(reason: str) -> None:
    """Skip a test whose real backend is missing here, but fail under CI: a green CI run means every
    backend really ran (the environment build installs them all)."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must run every backend", pytrace=False)
    pytest.skip(reason)


def _tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


class MooncakeMaster(MasterProcess):
    """A real ``mooncake_master`` (restartable on the same port; dies with the test process)."""

    def config(self, segment: str | int = "64MB", local_buffer: str | int = "16MB") -> dict[str, object]:
        return {
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": self.address,
            "protocol": "tcp",
            "global_segment_size": segment,
            "local_buffer_size": local_buffer,
        }


def _started(log: Path, lease_ttl_ms: int = 200) -> MooncakeMaster:
    master = MooncakeMaster(lease_ttl_ms=lease_ttl_ms, log_path=log)
    try:
        master.start()
    except StoreError as exc:
        _unavailable(f"mooncake_master unavailable: {exc}")
    return master


@pytest.fixture(scope="session")
def long_lease_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A real master whose leases (10 s) outlast big gets on a loaded machine.

    The shared master's 200 ms leases let eviction tests remove objects soon after a read, but a
    get of thousands of pieces can outlast them under load (LEASE_EXPIRED, a failed load).
    """
    master = _started(tmp_path_factory.mktemp("mooncake-long-lease") / "master.log", lease_ttl_ms=10_000)
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """One real master for the session, on a free loopback port; stopped at the end."""
    master = _started(tmp_path_factory.mktemp("mooncake") / "master.log")
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def fresh_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test only (for restart tests)."""
    master = _started(tmp_path / "master.log")
    try:
        yield master
    finally:
        master.stop()


@dataclass
class YuanrongWorker:
    """A running openYuanrong datasystem worker with its built-in metastore."""

    port: int
    home: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def yuanrong_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[YuanrongWorker]:
    """A real ``datasystem_worker`` started with ``dscli`` on loopback; stopped at the end."""
    dscli = _tool("dscli")
    if dscli is None:
        _unavailable("dscli not installed (install openyuanrong-datasystem)")
    home = tmp_path_factory.mktemp("yr")
    worker = YuanrongWorker(free_port(), home)
    meta = free_port()
    cmd = [
        dscli,
        "start",
        "-d",
        str(home / "home"),
        "-w",
        "--worker_address",
        worker.address,
        "--metastore_address",
        f"127.0.0.1:{meta}",
        "--start_metastore_service",
        "true",
        "--shared_memory_size_mb",
        "128",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if res.returncode != 0 or not wait_port(worker.port, 20):
        subprocess.run([dscli, "stop", "-w", worker.address], capture_output=True, timeout=30, check=False)
        pytest.fail(f"openYuanrong worker did not start: {res.stdout[-1500:]} {res.stderr[-1500:]}")
    try:
        yield worker
    finally:
        subprocess.run([dscli, "stop", "-w", worker.address], capture_output=True, timeout=30, check=False)


def make_kv_caches(
    *, num_layers: int = 2, num_blocks: int = 8, block_size: int = 16, heads: int = 2, dim: int = 8, seed: int = 0
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Split K/V CPU caches ``[num_blocks, block_size, heads, dim]`` fp16 filled from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.self_attn.attn": (
            torch.randn(num_blocks, block_size, heads, dim, generator=gen, dtype=torch.float32).to(torch.float16),
            torch.randn(num_blocks, block_size, heads, dim, generator=gen, dtype=torch.float32).to(torch.float16),
        )
        for i in range(num_layers)
    }


def block_bytes(caches: dict[str, tuple[torch.Tensor, torch.Tensor]], block: int) -> bytes:
    """Every byte of one block over all layers and K/V."""
    return b"".join(t[block].numpy().tobytes() for kv in caches.values() for t in kv)


os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


@dataclass(frozen=True)
class KVTools:
    """Helpers handed to tests (conftest modules are not importable under importlib mode)."""

    make: object = staticmethod(make_kv_caches)
    block_bytes: object = staticmethod(block_bytes)
    free_port: object = staticmethod(free_port)


@pytest.fixture
def kvtools() -> KVTools:
    """Cache builders and a free-port helper."""
    return KVTools()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint directory for vLLM's configs (vLLM imported only when a test asks for it)."""
    from ascend_dist.testing import vllm_builders

    return vllm_builders.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))
