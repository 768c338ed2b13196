"""The CPU simulation counts its device allocations (live and peak bytes), freed with their last view."""

from __future__ import annotations

import torch

from ascend_dist.common.device.cpu_sim import CpuSimRuntime


def test_live_and_peak_bytes_follow_allocations_and_their_views() -> None:
    with CpuSimRuntime(manual=True) as runtime:
        a = runtime.empty((1000,), torch.uint8)
        b = runtime.empty((10, 10), torch.float32)
        assert runtime.allocated_bytes == 1400 and runtime.peak_allocated_bytes == 1400
        view = a[100:200]
        del a
        assert runtime.allocated_bytes == 1400  # a view keeps its allocation alive
        del view
        assert runtime.allocated_bytes == 400 and runtime.peak_allocated_bytes == 1400
        runtime.reset_peak_allocated()
        assert runtime.peak_allocated_bytes == 400
        c = runtime.empty((50,), torch.int64)
        assert runtime.peak_allocated_bytes == 800
        del b, c
        assert runtime.allocated_bytes == 0
        torch.empty(4096)  # plain torch memory is host memory: not counted
        assert runtime.allocated_bytes == 0 and runtime.peak_allocated_bytes == 800
