"""Backend selection, the process-wide runtime, and the no-torch-at-import rule."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field

import pytest

from ascend_dist.common.device import (
    BACKENDS,
    DEVICE_ENV,
    BackendChoice,
    DeviceRuntime,
    close_runtime,
    create_runtime,
    get_runtime,
    select_backend,
)
from ascend_dist.common.device.cpu_sim import CpuSimRuntime
from ascend_dist.common.device.detect import SystemProbe
from ascend_dist.common.errors import ConfigError, DeviceUnavailable


@dataclass
class FakeProbe:
    """Answers fixed probe results and counts the calls."""

    npu_result: tuple[bool, str] = (False, "torch_npu not installed")
    cuda_result: tuple[bool, str] = (False, "CUDA not available")
    calls: list[str] = field(default_factory=list)

    def npu(self) -> tuple[bool, str]:
        self.calls.append("npu")
        return self.npu_result

    def cuda(self) -> tuple[bool, str]:
        self.calls.append("cuda")
        return self.cuda_result


NPU_OK = (True, "torch_npu importable and 8 NPU device(s) present")
CUDA_OK = (True, "CUDA available with 1 device(s)")
NPU_BROKEN = (
    False,
    "torch_npu present but unusable: ImportError: libhccl.so: cannot open shared object file",
)


@pytest.mark.parametrize(
    ("env", "npu", "cuda", "expected", "probed"),
    [
        # explicit choice
        ({DEVICE_ENV: "cpu"}, NPU_OK, CUDA_OK, BackendChoice("cpu", "ASCEND_DIST_DEVICE=cpu"), []),
        ({DEVICE_ENV: " CPU "}, NPU_OK, CUDA_OK, BackendChoice("cpu", "ASCEND_DIST_DEVICE=cpu"), []),
        ({DEVICE_ENV: "npu"}, NPU_OK, CUDA_OK, BackendChoice("npu", "ASCEND_DIST_DEVICE=npu"), ["npu"]),
        ({DEVICE_ENV: "cuda"}, NPU_OK, CUDA_OK, BackendChoice("cuda", "ASCEND_DIST_DEVICE=cuda"), ["cuda"]),
        # auto-detection: npu, then cuda, then cpu
        ({}, NPU_OK, CUDA_OK, BackendChoice("npu", NPU_OK[1]), ["npu"]),
        ({DEVICE_ENV: ""}, NPU_OK, CUDA_OK, BackendChoice("npu", NPU_OK[1]), ["npu"]),
        (
            {},
            (False, "torch_npu not installed"),
            CUDA_OK,
            BackendChoice("cuda", f"torch_npu not installed; {CUDA_OK[1]}"),
            ["npu", "cuda"],
        ),
        (
            {},
            (False, "torch_npu not installed"),
            (False, "CUDA not available"),
            BackendChoice("cpu", "torch_npu not installed; CUDA not available"),
            ["npu", "cuda"],
        ),
        (
            {},
            NPU_BROKEN,
            (False, "CUDA not available"),
            BackendChoice("cpu", f"{NPU_BROKEN[1]}; CUDA not available"),
            ["npu", "cuda"],
        ),
    ],
)
def test_selection_table(
    env: dict[str, str],
    npu: tuple[bool, str],
    cuda: tuple[bool, str],
    expected: BackendChoice,
    probed: list[str],
) -> None:
    probe = FakeProbe(npu, cuda)
    assert select_backend(env, probe) == expected
    assert probe.calls == probed


@pytest.mark.parametrize("value", ["gpu", "tpu", "npu0", "cpu,cuda"])
def test_unknown_backend_names_the_variable_and_allowed_values(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        select_backend({DEVICE_ENV: value}, FakeProbe())
    message = str(info.value)
    assert DEVICE_ENV in message
    assert value in message
    assert all(f"'{name}'" in message for name in BACKENDS)


@pytest.mark.parametrize(
    ("name", "probe", "why"),
    [
        ("npu", FakeProbe(npu_result=NPU_BROKEN), "libhccl.so"),
        ("npu", FakeProbe(npu_result=(False, "torch_npu importable but no NPU device present")), "no NPU"),
        ("cuda", FakeProbe(cuda_result=(False, "CUDA not available")), "CUDA not available"),
    ],
)
def test_requested_but_unusable_backend_says_why(name: str, probe: FakeProbe, why: str) -> None:
    with pytest.raises(DeviceUnavailable, match=why) as info:
        select_backend({DEVICE_ENV: name}, probe)
    assert f"{DEVICE_ENV}={name}" in str(info.value)


def test_system_probe_on_this_machine() -> None:
    # No NPU stack and no GPU in the test environment: both probes answer False with a reason.
    npu_ok, npu_why = SystemProbe().npu()
    assert not npu_ok
    assert npu_why
    cuda_ok, cuda_why = SystemProbe().cuda()
    if not cuda_ok:
        assert cuda_why == "CUDA not available"
    assert os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD") is not None


def test_create_runtime() -> None:
    runtime = create_runtime("cpu", manual=True)
    try:
        assert isinstance(runtime, CpuSimRuntime)
        assert isinstance(runtime, DeviceRuntime)
        assert runtime.manual
        assert (runtime.name, runtime.device_index) == ("cpu", 0)
    finally:
        runtime.close()
    with pytest.raises(ConfigError, match="name"):
        create_runtime("tpu")
    with pytest.raises(TypeError):
        create_runtime("cpu", no_such_option=1)


def test_get_runtime_is_one_per_process_and_thread_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    close_runtime()
    seen: list[DeviceRuntime] = []

    def fetch() -> None:
        seen.append(get_runtime())

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert len(seen) == 8
        assert all(r is seen[0] for r in seen)
        assert seen[0].name == "cpu"
    finally:
        close_runtime()
    close_runtime()  # idempotent


def test_importing_the_package_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import ascend_dist.common.device as d\n"
        "import ascend_dist.common.device.cpu_sim, ascend_dist.common.device.ipc\n"
        "d.select_backend({'ASCEND_DIST_DEVICE': 'cpu'})\n"
        "d.decode_ipc_handle(d.encode_ipc_handle(d.IpcHandle(version=1, backend='cpu', payload=b'x', "
        "offset=0, nbytes=1, dtype='uint8', shape=(1,), stride=(1,), device_index=0)))\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_an_unclosed_runtime_does_not_keep_the_interpreter_alive() -> None:
    code = (
        "import numpy as np\n"
        "from ascend_dist.common.device import CopyDirection, get_runtime\n"
        "rt = get_runtime()\n"
        "src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)\n"
        "stream = rt.new_stream()\n"
        "rt.batch_copy([src.ctypes.data], [dst.ctypes.data], [64], CopyDirection.D2D, stream=stream)\n"
        "print(rt.name)\n"
    )
    env = {**os.environ, DEVICE_ENV: "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cpu"
