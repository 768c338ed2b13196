"""Every rank on its own device: the process's runtimes are per device index (issue 25 item 2).

On the CPU simulation a "device" is the index a runtime stands for; `set_current_device` plays
torch's ``set_device`` (what vLLM's worker does with its local rank).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ascend_dist.common.device import (
    DEVICE_ENV,
    CpuSimRuntime,
    close_runtime,
    create_runtime,
    current_device_index,
    get_runtime,
    set_current_device,
)
from ascend_dist.common.errors import ConfigError


@pytest.fixture
def cpu_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    close_runtime()
    try:
        yield
    finally:
        close_runtime()


@pytest.mark.usefixtures("cpu_process")
def test_runtime_follows_the_current_device() -> None:
    assert current_device_index() == 0
    first = get_runtime()
    assert first.device_index == 0
    set_current_device(3)
    assert current_device_index() == 3
    third = get_runtime()
    assert third.device_index == 3 and third is not first
    assert get_runtime() is third  # one runtime per device, reused
    set_current_device(0)
    assert get_runtime() is first


@pytest.mark.usefixtures("cpu_process")
def test_an_explicit_device_wins_over_the_current_one() -> None:
    set_current_device(1)
    assert get_runtime(2).device_index == 2
    assert get_runtime("cpu:2") is get_runtime(2)
    assert get_runtime(torch.device("cpu", 2)) is get_runtime(2)
    # a device without an index (vLLM's CPU worker passes "cpu") means the current device
    assert get_runtime(torch.device("cpu")).device_index == 1
    assert get_runtime("cpu").device_index == 1


@pytest.mark.usefixtures("cpu_process")
def test_a_device_of_another_backend_is_refused() -> None:
    with pytest.raises(ConfigError, match="device"):
        get_runtime(torch.device("cuda", 1))
    with pytest.raises(ConfigError, match="device"):
        get_runtime("cpu:x")
    with pytest.raises(ConfigError, match="device"):
        get_runtime(-1)
    with pytest.raises(ConfigError, match="index"):
        set_current_device(-2)


@pytest.mark.usefixtures("cpu_process")
def test_close_runtime_closes_every_device_and_resets_the_current_one() -> None:
    runtimes = [get_runtime(i) for i in range(3)]
    set_current_device(2)
    close_runtime()
    for runtime in runtimes:
        assert isinstance(runtime, CpuSimRuntime)
        with pytest.raises(Exception, match="closed"):
            runtime.new_stream()
    assert current_device_index() == 0
    assert get_runtime(1) not in runtimes


def test_simulated_device_index_is_stamped_on_ipc_handles() -> None:
    with create_runtime("cpu", device_index=2) as runtime:
        assert isinstance(runtime, CpuSimRuntime)
        tensor = runtime.empty_shared(8, torch.uint8)
        assert runtime.ipc_handle(tensor).device_index == 2
    with pytest.raises(ConfigError, match="device_index"):
        create_runtime("cpu", device_index=-1)


@pytest.mark.usefixtures("cpu_process")
def test_tensors_runtime_is_their_devices_and_refuses_a_mix() -> None:
    from ascend_dist.common.device import tensors_runtime

    set_current_device(1)
    assert tensors_runtime([torch.zeros(1), torch.zeros(2)]) is get_runtime(1)
    with pytest.raises(ConfigError, match="tensors"):
        tensors_runtime([])
    with pytest.raises(ConfigError, match="tensors"):
        tensors_runtime([torch.zeros(1), torch.zeros(1, device="meta")])


@pytest.mark.usefixtures("cpu_process")
def test_a_forked_child_gets_runtimes_of_its_own() -> None:
    """A forked child inherited the parent's runtimes without their stream threads: its first op never ran."""
    import json
    import os

    parent = get_runtime()
    ran: list[int] = []
    parent.current_stream().enqueue("parent op", lambda: ran.append(1))
    parent.synchronize(timeout=5)  # the parent's stream thread is running
    assert ran == [1]
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        try:
            rt = get_runtime()
            done: list[int] = []
            rt.current_stream().enqueue("child op", lambda: done.append(1))
            rt.synchronize(timeout=5)
            report = {"own": rt is not parent, "ran": done == [1]}
        except BaseException as exc:
            report = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write_end, json.dumps(report).encode())
        os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as pipe:
            report = json.loads(pipe.read().decode() or "{}")
    finally:
        os.waitpid(pid, 0)
    assert report == {"own": True, "ran": True}, report
    assert get_runtime() is parent  # the parent keeps its own
