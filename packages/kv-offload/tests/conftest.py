"""Shared fixtures: CPU-simulated runtimes (manual-stepping and threaded); vLLM tests opt-in."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ascend_dist.common.device import CpuSimRuntime

HAVE_VLLM = importlib.util.find_spec("vllm") is not None

# --import-mode=importlib does not put this folder on sys.path; the vLLM tests import the
# `offload_vllm_loop` helper module from it by name.
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `vllm`-marked tests where the pinned vLLM is not installed (run them in .nox/vllm)."""
    del config
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="needs the pinned vllm: .nox/vllm/bin/python -m pytest -m vllm")
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def manual_rt() -> Iterator[CpuSimRuntime]:
    with CpuSimRuntime(manual=True) as runtime:
        yield runtime


@pytest.fixture
def rt() -> Iterator[CpuSimRuntime]:
    with CpuSimRuntime(wait_timeout_s=10.0) as runtime:
        yield runtime
