"""CPU simulation: stream order, cross-stream waits, events, timeouts and shutdown."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from ascend_dist.common.device import CopyDirection, DeviceRuntime, Event, Stream
from ascend_dist.common.device.cpu_sim import CpuSimRuntime, SimStream
from ascend_dist.common.errors import ConfigError, DeadlineExceeded, DeviceError


@pytest.fixture
def rt() -> Iterator[CpuSimRuntime]:
    with CpuSimRuntime() as runtime:
        yield runtime


@pytest.fixture
def manual() -> Iterator[CpuSimRuntime]:
    with CpuSimRuntime(manual=True) as runtime:
        yield runtime


def test_implements_the_protocols(rt: CpuSimRuntime) -> None:
    assert isinstance(rt, DeviceRuntime)
    assert isinstance(rt.new_stream(), Stream)
    assert isinstance(rt.new_event(), Event)
    assert rt.current_stream() is rt.compute_stream()


def test_fifo_order_within_a_stream(rt: CpuSimRuntime) -> None:
    seen: list[int] = []
    stream = rt.new_stream()
    for i in range(200):
        rt.launch_host_func(stream, lambda i=i: seen.append(i))
    stream.synchronize(timeout=5)
    assert seen == list(range(200))
    assert stream.query()


def test_fifo_order_in_manual_mode(manual: CpuSimRuntime) -> None:
    seen: list[int] = []
    stream = manual.new_stream()
    for i in range(5):
        manual.launch_host_func(stream, lambda i=i: seen.append(i))
    assert stream.pending() == 5
    assert stream.step(2) == 2
    assert seen == [0, 1]
    assert stream.step(10) == 3
    assert seen == [0, 1, 2, 3, 4]
    assert stream.step() == 0
    assert stream.query()


def test_copy_waiting_on_event_runs_only_after_the_event_stream_reaches_it(manual: CpuSimRuntime) -> None:
    """D2H starts only after compute wrote the block: a store waits on the compute stream's event."""
    device_block = manual.empty((64,), torch.uint8).zero_()
    host_block = manual.pinned_empty((64,), torch.uint8).zero_()
    compute, transfer = manual.compute_stream(), manual.new_stream()
    written = manual.new_event()

    manual.launch_host_func(compute, lambda: device_block.fill_(0xAB))  # "the kernel writing the block"
    written.record(compute)
    transfer.wait_event(written)
    manual.batch_copy([device_block.data_ptr()], [host_block.data_ptr()], [64], CopyDirection.D2H, stream=transfer)

    assert transfer.step(5) == 0  # blocked: the event has not fired
    assert compute.step(1) == 1  # compute writes ...
    assert transfer.step(5) == 0  # ... but the marker is still queued
    assert not written.query()
    assert torch.count_nonzero(host_block) == 0
    assert compute.step(1) == 1  # marker fires
    assert written.query()
    assert transfer.step(5) == 2  # the wait, then the copy
    assert torch.all(host_block == 0xAB)


def test_wait_stream_orders_against_work_enqueued_so_far(manual: CpuSimRuntime) -> None:
    seen: list[str] = []
    a, b = manual.new_stream(), manual.new_stream()
    manual.launch_host_func(a, lambda: seen.append("a1"))
    b.wait_stream(a)
    manual.launch_host_func(b, lambda: seen.append("b1"))
    manual.launch_host_func(a, lambda: seen.append("a2"))  # after the wait: b need not wait for it
    assert b.step(3) == 0
    assert a.step(1) == 1
    assert a.step(1) == 1  # the marker recorded by wait_stream
    assert b.step(3) == 2
    assert seen == ["a1", "b1"]
    assert manual.run_until_idle() == 1
    assert seen == ["a1", "b1", "a2"]


def test_cross_stream_wait_with_real_threads(rt: CpuSimRuntime) -> None:
    src = rt.empty((4096,), torch.uint8).zero_()
    dst = rt.empty((4096,), torch.uint8).zero_()
    compute, transfer = rt.compute_stream(), rt.new_stream()

    def slow_write() -> None:
        time.sleep(0.05)
        src.fill_(7)

    rt.launch_host_func(compute, slow_write)
    done = compute.record_event()
    transfer.wait_event(done)
    rt.batch_copy([src.data_ptr()], [dst.data_ptr()], [4096], CopyDirection.D2H, stream=transfer)
    transfer.synchronize(timeout=5)
    assert torch.all(dst == 7)


def test_event_query_synchronize_and_elapsed(rt: CpuSimRuntime) -> None:
    stream = rt.new_stream()
    start, end = rt.new_event(timing=True), rt.new_event(timing=True)
    assert not start.query()  # never recorded
    gate = threading.Event()
    start.record(stream)
    rt.launch_host_func(stream, lambda: gate.wait(5))
    rt.launch_host_func(stream, lambda: time.sleep(0.03))
    end.record(stream)
    assert not end.query()
    gate.set()
    end.synchronize(timeout=5)
    assert start.query() and end.query()
    assert 25.0 <= start.elapsed_ms(end) < 5000.0


def test_elapsed_needs_timing_and_completion(manual: CpuSimRuntime) -> None:
    plain, timed_a, timed_b = manual.new_event(), manual.new_event(timing=True), manual.new_event(timing=True)
    with pytest.raises(DeviceError, match="timing=True"):
        plain.elapsed_ms(timed_a)
    timed_a.record()
    timed_b.record()
    with pytest.raises(DeviceError, match="complete"):
        timed_a.elapsed_ms(timed_b)
    manual.run_until_idle()
    assert timed_a.elapsed_ms(timed_b) >= 0.0


def test_record_uses_the_current_stream(manual: CpuSimRuntime) -> None:
    side = manual.new_stream()
    event = manual.new_event()
    with manual.use_stream(side) as current:
        assert current is side
        assert manual.current_stream() is side
        event.record()
    assert manual.current_stream() is manual.compute_stream()
    assert side.pending() == 1
    assert manual.compute_stream().pending() == 0


def test_current_stream_is_thread_local(rt: CpuSimRuntime) -> None:
    side = rt.new_stream()
    seen: list[SimStream] = []
    inside = threading.Event()
    release = threading.Event()

    def other_thread() -> None:
        inside.wait(5)
        seen.append(rt.current_stream())
        release.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with rt.use_stream(side):
        inner = rt.new_stream()
        with rt.use_stream(inner):
            assert rt.current_stream() is inner
        assert rt.current_stream() is side
        inside.set()
        release.wait(5)
    worker.join(5)
    assert seen == [rt.compute_stream()]


def test_event_never_recorded_times_out(rt: CpuSimRuntime) -> None:
    event = rt.new_event()
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="event"):
        event.synchronize(timeout=0.05)
    assert time.monotonic() - started < 2.0


def test_stream_synchronize_times_out_in_manual_mode(manual: CpuSimRuntime) -> None:
    manual.launch_host_func(manual.compute_stream(), lambda: None)
    with pytest.raises(DeadlineExceeded, match="stream"):
        manual.compute_stream().synchronize(timeout=0.05)
    with pytest.raises(DeadlineExceeded):
        manual.synchronize(timeout=0.05)


def test_blocked_wait_times_out_on_the_stream_and_the_stream_continues() -> None:
    with CpuSimRuntime(wait_timeout_s=0.1) as rt:
        stream = rt.new_stream()
        seen: list[str] = []
        stream.wait_event(rt.new_event())  # never recorded
        rt.launch_host_func(stream, lambda: seen.append("after"))
        with pytest.raises(DeadlineExceeded, match="wait_event"):
            stream.synchronize(timeout=5)
        assert seen == ["after"]
        stream.synchronize(timeout=5)  # reported once


def test_failing_host_function_is_a_sticky_stream_error(rt: CpuSimRuntime) -> None:
    stream = rt.new_stream()

    def boom() -> None:
        raise ValueError("bad callback")

    rt.launch_host_func(stream, boom)
    with pytest.raises(DeviceError, match="bad callback"):
        stream.synchronize(timeout=5)
    stream.synchronize(timeout=5)


def test_step_needs_manual_mode(rt: CpuSimRuntime) -> None:
    with pytest.raises(DeviceError, match="manual=True"):
        rt.compute_stream().step()


def test_foreign_streams_and_events_are_refused(rt: CpuSimRuntime) -> None:
    with CpuSimRuntime(manual=True) as other:
        foreign = other.new_stream()
        with pytest.raises(ConfigError, match="stream"):
            rt.launch_host_func(foreign, lambda: None)
        with pytest.raises(ConfigError, match="stream"), rt.use_stream(foreign):
            pass
        with pytest.raises(ConfigError, match="stream"):
            rt.batch_copy([1], [2], [0], CopyDirection.D2D, stream=foreign)
        with pytest.raises(ConfigError, match="stream"):
            rt.new_event().record(foreign)
        with pytest.raises(ConfigError, match="event"):
            rt.compute_stream().wait_event(other.new_event())


@pytest.mark.parametrize(("latency", "wait"), [(-1.0, 1.0), (0.0, 0.0)])
def test_constructor_validates(latency: float, wait: float) -> None:
    with pytest.raises(ConfigError):
        CpuSimRuntime(copy_latency_s=latency, wait_timeout_s=wait)


def test_close_joins_every_thread_and_is_idempotent() -> None:
    baseline = set(threading.enumerate())
    rt = CpuSimRuntime()
    streams = [rt.new_stream() for _ in range(4)]
    done: list[int] = []
    for i, stream in enumerate(streams):
        rt.launch_host_func(stream, lambda i=i: (time.sleep(0.02), done.append(i)))
    assert len(set(threading.enumerate()) - baseline) == 5  # compute + 4
    rt.close()
    assert set(threading.enumerate()) == baseline
    assert sorted(done) == [0, 1, 2, 3]  # queued work finished before the threads ended
    rt.close()
    with pytest.raises(DeviceError, match="closed"):
        rt.new_stream()
    with pytest.raises(DeviceError, match="closed"):
        rt.launch_host_func(streams[0], lambda: None)


def test_close_abandons_a_blocked_wait_promptly() -> None:
    baseline = set(threading.enumerate())
    rt = CpuSimRuntime()
    rt.new_stream().wait_event(rt.new_event())  # would block for the 60 s default
    started = time.monotonic()
    rt.close()
    assert time.monotonic() - started < 2.0
    assert set(threading.enumerate()) == baseline
