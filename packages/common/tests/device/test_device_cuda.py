"""Hardware backends (`TorchDeviceRuntime`): streams, events, batched copies and IPC on a real device.

Every test runs for CUDA (marker ``cuda``) and, on Ascend machines, for NPU (marker ``npu``); each
parameter skips unless its hardware is present. Run on a GPU machine with ``pytest -m cuda``.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from ascend_dist.common.device import (
    MAX_DESCRIPTORS_PER_CALL,
    CopyDirection,
    DeviceRuntime,
    create_runtime,
    decode_ipc_handle,
    encode_ipc_handle,
)
from ascend_dist.common.device.detect import SystemProbe
from ascend_dist.common.device.torch_backend import TorchDeviceRuntime
from ascend_dist.common.errors import ConfigError, DeadlineExceeded, DeviceError

_HAS_CUDA = torch.cuda.is_available()
_HAS_NPU = SystemProbe().npu()[0]

BACKEND_PARAMS = [
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not _HAS_CUDA, reason="needs an NVIDIA GPU")]),
    pytest.param("npu", marks=[pytest.mark.npu, pytest.mark.skipif(not _HAS_NPU, reason="needs an Ascend NPU")]),
]
PAGE = 4096


@pytest.fixture(params=BACKEND_PARAMS)
def rt(request: pytest.FixtureRequest) -> Iterator[TorchDeviceRuntime]:
    runtime = create_runtime(request.param)
    assert isinstance(runtime, TorchDeviceRuntime)
    try:
        yield runtime
    finally:
        runtime.synchronize(timeout=60)
        runtime.close()
        runtime.close()  # idempotent


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8))


def _ptrs(base: torch.Tensor, blocks: list[int] | np.ndarray, page: int) -> np.ndarray:
    return base.data_ptr() + np.asarray(blocks, dtype=np.int64) * page


def _long_kernel(rt: TorchDeviceRuntime) -> None:
    if rt.name != "cuda":
        pytest.skip("needs a kernel of known duration (torch.cuda._sleep)")
    torch.cuda._sleep(300_000_000)  # a few hundred ms of GPU time


def test_streams(rt: TorchDeviceRuntime) -> None:
    assert isinstance(rt, DeviceRuntime)
    module = getattr(torch, rt.name)
    compute = rt.compute_stream()
    assert compute.raw == module.default_stream(rt.device)
    assert rt.current_stream() == compute
    side = rt.new_stream()
    assert side != compute
    assert side.handle != 0
    with rt.use_stream(side) as current:
        assert current == side
        assert rt.current_stream() == side
        assert module.current_stream(rt.device) == side.raw
    assert rt.current_stream() == compute
    side.synchronize(timeout=10)
    assert side.query()


def test_events_order_streams_and_time_work(rt: TorchDeviceRuntime) -> None:
    producer, consumer = rt.new_stream(), rt.new_stream()
    start, end = rt.new_event(timing=True), rt.new_event(timing=True)
    src = rt.empty((1 << 20,), torch.float32)
    with rt.use_stream(producer):
        start.record()
        src.fill_(3.0)
        for _ in range(20):
            src.mul_(1.0)
        end.record()
    consumer.wait_event(end)
    with rt.use_stream(consumer):
        dst = src * 2
    consumer.synchronize(timeout=30)
    assert end.query()
    end.synchronize(timeout=10)
    assert start.elapsed_ms(end) > 0.0
    assert torch.all(dst.cpu() == 6.0)


def test_timeouts_raise_deadline_exceeded(rt: TorchDeviceRuntime) -> None:
    stream = rt.new_stream()
    with rt.use_stream(stream):
        _long_kernel(rt)
        event = stream.record_event()
    assert not event.query()
    with pytest.raises(DeadlineExceeded):
        event.synchronize(timeout=0.001)
    with pytest.raises(DeadlineExceeded):
        stream.synchronize(timeout=0.001)
    stream.synchronize(timeout=30)
    assert event.query()


@pytest.mark.parametrize("direction", list(CopyDirection))
def test_batch_copy_scattered_bytes(rt: TorchDeviceRuntime, direction: CopyDirection) -> None:
    n_blocks = 64
    host_src = _random_bytes(n_blocks * PAGE, seed=int(direction))
    src_blocks = [11, 12, 13, 3, 30, 0, 63, 40]
    dst_blocks = [1, 2, 3, 17, 5, 31, 62, 7]
    if direction is CopyDirection.H2D:
        src = rt.pinned_empty((n_blocks * PAGE,), torch.uint8)
        src.copy_(host_src)
        dst = rt.empty((n_blocks * PAGE,), torch.uint8).zero_()
    elif direction is CopyDirection.D2H:
        src = host_src.to(rt.device)
        dst = rt.pinned_empty((n_blocks * PAGE,), torch.uint8).zero_()
    else:
        src = host_src.to(rt.device)
        dst = rt.empty((n_blocks * PAGE,), torch.uint8).zero_()
    rt.synchronize(timeout=30)  # the fills above ran on the compute stream
    expected = torch.zeros(n_blocks * PAGE, dtype=torch.uint8)
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        expected[d * PAGE : (d + 1) * PAGE] = host_src[s * PAGE : (s + 1) * PAGE]
    stream = rt.new_stream()
    rt.batch_copy(
        _ptrs(src, src_blocks, PAGE),
        _ptrs(dst, dst_blocks, PAGE),
        np.full(len(src_blocks), PAGE, dtype=np.int64),
        direction,
        stream=stream,
    )
    stream.synchronize(timeout=30)
    assert torch.equal(dst.cpu(), expected)


@pytest.mark.parametrize("direction", [CopyDirection.D2D, CopyDirection.D2H])
def test_batch_copy_more_than_4096_descriptors(rt: TorchDeviceRuntime, direction: CopyDirection) -> None:
    n, size = 10_000, 8
    assert n > 2 * MAX_DESCRIPTORS_PER_CALL
    host_src = _random_bytes(n * size, seed=5)
    src = host_src.to(rt.device)
    dst = (
        rt.empty((n * size,), torch.uint8)
        if direction is CopyDirection.D2D
        else rt.pinned_empty((n * size,), torch.uint8)
    )
    dst.zero_()
    rt.synchronize(timeout=30)
    order = np.random.default_rng(2).permutation(n)
    stream = rt.new_stream()
    with rt.use_stream(stream):  # the current stream is the default target
        rt.batch_copy(_ptrs(src, np.arange(n), size), _ptrs(dst, order, size), np.full(n, size), direction)
    stream.synchronize(timeout=30)
    expected = np.empty(n * size, dtype=np.uint8)
    expected.reshape(n, size)[order] = host_src.numpy().reshape(n, size)
    assert np.array_equal(dst.cpu().numpy(), expected)


def test_batch_copy_validation_and_no_op(rt: TorchDeviceRuntime) -> None:
    rt.batch_copy([], [], [], CopyDirection.H2D)
    with pytest.raises(ConfigError, match="sizes"):
        rt.batch_copy([1], [2], [-1], CopyDirection.H2D)
    with pytest.raises(ConfigError, match="direction"):
        rt.batch_copy([1], [2], [1], 9)


def test_host_function_runs_after_preceding_work(rt: TorchDeviceRuntime) -> None:
    stream = rt.new_stream()
    data = rt.empty((1 << 16,), torch.float32)
    seen: list[float] = []
    ran = threading.Event()
    host = rt.pinned_empty((1 << 16,), torch.float32).zero_()
    host_view = host.numpy()  # read without torch inside the callback (it must not call the device)
    with rt.use_stream(stream):
        data.fill_(5.0)
        host.copy_(data, non_blocking=True)
    rt.launch_host_func(stream, lambda: (seen.append(float(host_view[-1])), ran.set()))
    assert ran.wait(30)
    assert seen == [5.0]
    stream.synchronize(timeout=30)


def test_ipc_handle_refusals(rt: TorchDeviceRuntime) -> None:
    with pytest.raises(DeviceError, match="needs a tensor on"):
        rt.ipc_handle(torch.zeros(4))
    with pytest.raises(ConfigError, match="storage"):
        rt.ipc_handle(rt.empty((0,), torch.float32))
    handle = rt.ipc_handle(rt.empty((4,), torch.float32))
    assert handle.backend == rt.name
    cpu = create_runtime("cpu")
    try:
        with pytest.raises(DeviceError, match=f"backend '{rt.name}'"):
            cpu.open_ipc_handle(handle)
    finally:
        cpu.close()


# Runs in a spawned child (which cannot import this module, so it gets source text for `exec`).
_CHILD = """
import torch
from ascend_dist.common.device import create_runtime, decode_ipc_handle

rt = create_runtime(backend)
try:
    tensor = rt.open_ipc_handle(decode_ipc_handle(handle_bytes))
    if tuple(tensor.shape) != shape:
        raise SystemExit(2)
    if mode == "write":
        tensor.mul_(2)
    elif tensor.cpu().tolist() != expected:
        raise SystemExit(3)
    rt.synchronize(timeout=60)
finally:
    rt.close()
"""


def _run_child(backend: str, handle_bytes: bytes, shape: tuple[int, ...], mode: str, expected: torch.Tensor) -> int:
    ctx = multiprocessing.get_context("spawn")
    scope = {
        "backend": backend,
        "handle_bytes": handle_bytes,
        "shape": shape,
        "mode": mode,
        "expected": expected.tolist(),
    }
    child = ctx.Process(target=exec, args=(_CHILD, scope))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        child.join(10)
    return child.exitcode if child.exitcode is not None else -1


def test_ipc_across_two_spawned_processes(rt: TorchDeviceRuntime) -> None:
    base = torch.arange(64 * 64, dtype=torch.float32).view(64, 64)
    shared = base.to(rt.device)
    view = shared[8:40:2, 4:60]  # strided, offset view
    handle = rt.ipc_handle(view)
    assert handle.backend == rt.name
    assert handle.offset == (8 * 64 + 4) * 4
    handle_bytes = encode_ipc_handle(handle)
    assert decode_ipc_handle(handle_bytes) == handle
    rt.synchronize(timeout=30)

    shape = tuple(view.shape)
    assert _run_child(rt.name, handle_bytes, shape, "write", base[8:40:2, 4:60]) == 0
    expected = base.clone()
    expected[8:40:2, 4:60] *= 2
    assert torch.equal(shared.cpu(), expected)  # the writer's bytes, seen here
    # one handle per consumer: torch counts one release per share
    second = encode_ipc_handle(rt.ipc_handle(view))
    assert _run_child(rt.name, second, shape, "read", expected[8:40:2, 4:60]) == 0
