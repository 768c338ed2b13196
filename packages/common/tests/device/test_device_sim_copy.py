"""CPU simulation: batched copies (bytes, splitting, validation, fault injection, latency)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.common.device import MAX_DESCRIPTORS_PER_CALL, CopyDirection
from ascend_dist.common.device.cpu_sim import CpuSimRuntime
from ascend_dist.common.errors import BatchCopyError, ConfigError, DeviceError

PAGE = 256


@pytest.fixture
def rt() -> Iterator[CpuSimRuntime]:
    with CpuSimRuntime() as runtime:
        yield runtime


def _random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8))


def _scatter_descriptors(
    src: torch.Tensor, dst: torch.Tensor, src_blocks: list[int], dst_blocks: list[int], page: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src_ptrs = np.array([src.data_ptr() + b * page for b in src_blocks], dtype=np.int64)
    dst_ptrs = np.array([dst.data_ptr() + b * page for b in dst_blocks], dtype=np.int64)
    return src_ptrs, dst_ptrs, np.full(len(src_blocks), page, dtype=np.int64)


@pytest.mark.parametrize("direction", list(CopyDirection))
def test_scattered_blocks_arrive_byte_exact(rt: CpuSimRuntime, direction: CopyDirection) -> None:
    device = _random_bytes(64 * PAGE, seed=int(direction))
    host = rt.pinned_empty((32 * PAGE,), torch.uint8).zero_()
    src_t, dst_t = (host, device) if direction is CopyDirection.H2D else (device, host)
    if direction is CopyDirection.H2D:
        host.copy_(_random_bytes(32 * PAGE, seed=9))
        device.zero_()
    src_blocks = [11, 12, 13, 3, 30, 0] if direction is not CopyDirection.H2D else [7, 1, 31, 2, 9, 4]
    dst_blocks = [1, 2, 3, 17, 5, 31] if direction is not CopyDirection.H2D else [40, 41, 63, 0, 5, 22]
    expected = dst_t.clone()
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        expected[d * PAGE : (d + 1) * PAGE] = src_t[s * PAGE : (s + 1) * PAGE]
    stream = rt.new_stream()
    rt.batch_copy(*_scatter_descriptors(src_t, dst_t, src_blocks, dst_blocks, PAGE), direction, stream=stream)
    stream.synchronize(timeout=5)
    assert torch.equal(dst_t, expected)


def test_copy_uses_the_current_stream_and_sequences_work(manual_rt: CpuSimRuntime) -> None:
    src = _random_bytes(64)
    dst = torch.zeros(64, dtype=torch.uint8)
    side = manual_rt.new_stream()
    with manual_rt.use_stream(side):
        manual_rt.batch_copy([src.data_ptr()], [dst.data_ptr()], [64], CopyDirection.D2D)
    assert side.pending() == 1
    assert manual_rt.compute_stream().pending() == 0
    side.step()
    assert torch.equal(src, dst)


@pytest.fixture
def manual_rt() -> Iterator[CpuSimRuntime]:
    with CpuSimRuntime(manual=True) as runtime:
        yield runtime


def test_more_than_4096_descriptors_are_split_and_all_copied(manual_rt: CpuSimRuntime) -> None:
    n, size = 10_000, 8
    src = _random_bytes(n * size, seed=3)
    dst = torch.zeros(n * size, dtype=torch.uint8)
    order = np.random.default_rng(1).permutation(n)  # scattered destinations
    src_ptrs = src.data_ptr() + np.arange(n, dtype=np.int64) * size
    dst_ptrs = dst.data_ptr() + order.astype(np.int64) * size
    manual_rt.batch_copy(src_ptrs, dst_ptrs, np.full(n, size, dtype=np.int64), CopyDirection.D2H)
    stream = manual_rt.compute_stream()
    assert stream.pending() == -(-n // MAX_DESCRIPTORS_PER_CALL) == 3  # one closure per native call
    assert stream.step(3) == 3
    expected = np.empty(n * size, dtype=np.uint8)
    expected.reshape(n, size)[order] = src.numpy().reshape(n, size)
    assert np.array_equal(dst.numpy(), expected)


def test_empty_batch_is_a_no_op(manual_rt: CpuSimRuntime) -> None:
    manual_rt.batch_copy([], [], [], CopyDirection.H2D)
    manual_rt.batch_copy(np.array([], dtype=np.int64), np.array([], dtype=np.int64), [], CopyDirection.D2D)
    assert manual_rt.compute_stream().pending() == 0


def test_zero_size_descriptors_copy_nothing(rt: CpuSimRuntime) -> None:
    src = _random_bytes(16)
    dst = torch.zeros(16, dtype=torch.uint8)
    rt.batch_copy([src.data_ptr(), src.data_ptr() + 8], [dst.data_ptr(), dst.data_ptr() + 8], [0, 8], 2)
    rt.synchronize(timeout=5)
    assert torch.count_nonzero(dst[:8]) == 0
    assert torch.equal(dst[8:], src[8:])


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (([1, 2], [3], [4, 5], CopyDirection.D2D), "src_ptrs/dst_ptrs/sizes"),
        (([1], [2], [-4], CopyDirection.D2D), "sizes"),
        (([1], [2], [4], 7), "direction"),
    ],
)
def test_validation_errors_are_raised_at_the_call(
    manual_rt: CpuSimRuntime, args: tuple[object, ...], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        manual_rt.batch_copy(*args)  # type: ignore[arg-type]
    assert manual_rt.compute_stream().pending() == 0


@pytest.mark.parametrize("k", [0, 1, 4095, 4096, 5000, 9999])
def test_fault_at_k_copies_before_k_only_and_is_sticky(rt: CpuSimRuntime, k: int) -> None:
    n, size = 10_000, 4
    src = _random_bytes(n * size, seed=k)
    dst = torch.zeros(n * size, dtype=torch.uint8)
    stream = rt.new_stream()
    rt.inject_copy_fault(k, reason="simulated HBM error")
    rt.batch_copy(
        src.data_ptr() + np.arange(n) * size,
        dst.data_ptr() + np.arange(n) * size,
        np.full(n, size),
        CopyDirection.D2H,
        stream=stream,
    )
    after = stream.record_event()
    with pytest.raises(BatchCopyError, match="simulated HBM error") as info:
        stream.synchronize(timeout=5)
    assert info.value.index == k
    assert torch.equal(dst[: k * size], src[: k * size])
    assert torch.count_nonzero(dst[k * size :]) == 0
    with pytest.raises(BatchCopyError) as again:
        after.synchronize(timeout=5)  # an event recorded after the failure reports it too
    assert again.value.index == k
    stream.synchronize(timeout=5)  # reported once per stream

    # the fault is consumed: the next batch copies everything
    rt.batch_copy([src.data_ptr()], [dst.data_ptr() + k * size], [n * size - k * size], 1, stream=stream)
    stream.synchronize(timeout=5)


def test_runtime_synchronize_reports_a_stream_failure(rt: CpuSimRuntime) -> None:
    buf = _random_bytes(64)
    rt.inject_copy_fault(2)
    rt.batch_copy([buf.data_ptr()] * 4, [buf.data_ptr() + 32] * 4, [8] * 4, CopyDirection.D2D, stream=rt.new_stream())
    with pytest.raises(BatchCopyError) as info:
        rt.synchronize(timeout=5)
    assert info.value.index == 2
    rt.synchronize(timeout=5)


def test_fault_beyond_the_batch_is_consumed_with_a_warning(rt: CpuSimRuntime, caplog: pytest.LogCaptureFixture) -> None:
    src, dst = _random_bytes(8), torch.zeros(8, dtype=torch.uint8)
    rt.inject_copy_fault(5)
    with caplog.at_level(logging.WARNING):
        rt.batch_copy([src.data_ptr()], [dst.data_ptr()], [8], CopyDirection.D2D)
    rt.synchronize(timeout=5)
    assert torch.equal(src, dst)
    assert "beyond a batch of 1" in caplog.text
    with pytest.raises(ConfigError, match="at_descriptor"):
        rt.inject_copy_fault(-1)


def test_latency_is_paid_per_native_call_not_at_submit() -> None:
    with CpuSimRuntime(copy_latency_s=0.05) as rt:
        n = MAX_DESCRIPTORS_PER_CALL + 1  # two native calls
        src, dst = _random_bytes(n), torch.zeros(n, dtype=torch.uint8)
        start, end = rt.new_event(timing=True), rt.new_event(timing=True)
        start.record()
        submitted = time.monotonic()
        rt.batch_copy(src.data_ptr() + np.arange(n), dst.data_ptr() + np.arange(n), np.ones(n, dtype=np.int64), 1)
        assert time.monotonic() - submitted < 0.05
        end.record()
        end.synchronize(timeout=5)
        assert start.elapsed_ms(end) >= 95.0
        assert torch.equal(src, dst)


def test_batch_copy_after_close_is_refused() -> None:
    rt = CpuSimRuntime()
    rt.close()
    with pytest.raises(DeviceError, match="closed"):
        rt.batch_copy([1], [2], [3], CopyDirection.D2D)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    n_blocks=st.integers(1, 40),
    page=st.sampled_from([1, 8, 24, 256]),
)
def test_any_disjoint_scatter_is_byte_exact(data: st.DataObject, n_blocks: int, page: int) -> None:
    count = data.draw(st.integers(0, n_blocks))
    src_blocks = data.draw(st.lists(st.integers(0, n_blocks - 1), min_size=count, max_size=count))
    dst_blocks = data.draw(st.permutations(range(n_blocks)))[:count]  # disjoint destinations
    src = _random_bytes(n_blocks * page, seed=page)
    dst = torch.zeros(n_blocks * page, dtype=torch.uint8)
    expected = dst.clone()
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        expected[d * page : (d + 1) * page] = src[s * page : (s + 1) * page]
    with CpuSimRuntime(manual=True) as rt:
        rt.batch_copy(*_scatter_descriptors(src, dst, src_blocks, dst_blocks, page), CopyDirection.D2D)
        rt.run_until_idle()
    assert torch.equal(dst, expected)
