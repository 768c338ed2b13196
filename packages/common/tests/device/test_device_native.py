"""Hardware-backend plumbing that runs without hardware: descriptor issuing, ctypes bindings, refusals."""

from __future__ import annotations

import threading

import msgspec
import numpy as np
import pytest
import torch

from ascend_dist.common.device import IPC_HANDLE_VERSION, IpcHandle, validate_batch
from ascend_dist.common.device._native_copy import (
    _CALLBACKS,
    _TRAMPOLINE,
    AclRuntimeLib,
    CudaRuntimeLib,
    find_library,
    issue_descriptors,
)
from ascend_dist.common.device._torch_ipc import open_storage_handle
from ascend_dist.common.device.torch_backend import TorchDeviceRuntime, _wait_until
from ascend_dist.common.errors import (
    BatchCopyError,
    ConfigError,
    DeadlineExceeded,
    DeviceUnavailable,
    ProtocolError,
)


class RecordingMemcpy:
    """A fake native memcpy: records calls, fails at one descriptor."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.fail_at = fail_at

    def __call__(self, src: int, dst: int, size: int) -> int:
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            return 700
        self.calls.append((src, dst, size))
        return 0


def _batch(n: int) -> object:
    idx = np.arange(n, dtype=np.int64)
    return validate_batch(1000 + idx, 50_000 + idx, np.ones(n, dtype=np.int64), 2)


def test_issue_calls_every_descriptor_in_order() -> None:
    memcpy = RecordingMemcpy()
    issue_descriptors(_batch(10_000), memcpy, str)  # type: ignore[arg-type]
    assert memcpy.calls == [(1000 + i, 50_000 + i, 1) for i in range(10_000)]


def test_issue_skips_empty_descriptors() -> None:
    memcpy = RecordingMemcpy()
    issue_descriptors(validate_batch([1, 2, 3], [4, 5, 6], [8, 0, 8], 0), memcpy, str)
    assert memcpy.calls == [(1, 4, 8), (3, 6, 8)]


@pytest.mark.parametrize("k", [0, 4095, 4096, 9999])
def test_issue_reports_the_global_failing_index(k: int) -> None:
    memcpy = RecordingMemcpy(fail_at=k)
    with pytest.raises(BatchCopyError, match="code 700") as info:
        issue_descriptors(_batch(10_000), memcpy, lambda code: f"code {code}")  # type: ignore[arg-type]
    assert info.value.index == k
    assert len(memcpy.calls) == k


def test_host_function_trampoline_dispatches_once() -> None:
    seen: list[str] = []
    key = _CALLBACKS.add(lambda: seen.append("ran"))
    _TRAMPOLINE(key)  # called through C, as the CUDA runtime would
    _TRAMPOLINE(key)  # a second call finds nothing
    assert seen == ["ran"]


def test_host_function_exception_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def boom() -> None:
        raise ValueError("callback failed")

    _TRAMPOLINE(_CALLBACKS.add(boom))
    assert "host function" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error path of a machine without a GPU")
def test_cudart_binding_reports_errors_as_batch_copy_error() -> None:
    try:
        lib = CudaRuntimeLib()
    except DeviceUnavailable:
        pytest.skip("no libcudart in this environment")
    src, dst = np.zeros(8, dtype=np.uint8), np.ones(8, dtype=np.uint8)
    batch = validate_batch([src.ctypes.data, src.ctypes.data], [dst.ctypes.data, dst.ctypes.data], [0, 8], 2)
    with pytest.raises(BatchCopyError, match="cudaMemcpyAsync returned") as info:
        lib.copy(batch, 0)
    assert info.value.index == 1  # descriptor 0 copies nothing and is skipped
    assert dst.tolist() == [1] * 8


def test_missing_library_is_device_unavailable() -> None:
    with pytest.raises(DeviceUnavailable, match="libascend_dist_no_such_lib"):
        find_library("libascend_dist_no_such_lib.so", "ascend_dist_no_such_lib")
    with pytest.raises(DeviceUnavailable, match="cannot load"):
        AclRuntimeLib("/nonexistent/libascendcl.so")


def test_torch_runtime_refusals() -> None:
    with pytest.raises(ConfigError, match="name"):
        TorchDeviceRuntime("tpu")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="device_index"):
        TorchDeviceRuntime("cuda", -1)
    with pytest.raises(DeviceUnavailable):
        TorchDeviceRuntime("cuda", 10_000)


def test_wait_until_polls_to_the_deadline() -> None:
    flag = threading.Event()
    timer = threading.Timer(0.02, flag.set)
    timer.start()
    _wait_until(flag.is_set, 5.0, "flag")
    timer.join(5)
    with pytest.raises(DeadlineExceeded, match=r"never did not complete within 0\.01 s"):
        _wait_until(lambda: False, 0.01, "never")


def _storage_handle(payload: bytes, offset: int = 0) -> IpcHandle:
    return IpcHandle(
        version=IPC_HANDLE_VERSION,
        backend="cuda",
        payload=payload,
        offset=offset,
        nbytes=64,
        dtype="float32",
        shape=(16,),
        stride=(1,),
        device_index=0,
    )


def test_storage_handle_payload_is_validated_before_touching_the_device() -> None:
    with pytest.raises(ProtocolError, match=r"malformed cuda IpcHandle\.payload"):
        open_storage_handle(_storage_handle(b"garbage"), "cuda", torch.device("cuda", 0))
    parts = msgspec.msgpack.encode([0, b"h" * 64, 64, 0, b"/torch_rc", 0, None, False])
    with pytest.raises(ProtocolError, match="does not fit"):
        open_storage_handle(_storage_handle(parts, offset=4), "cuda", torch.device("cuda", 0))
