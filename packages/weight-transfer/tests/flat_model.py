"""A flat model and a sink whose loader can fail half-way, shared by the weight-update failure tests.

Used by the npu_ipc failure tests and the broadcast load-restore tests. `FailingSink` is a fake of
our own `WeightSink` Protocol (a `ModuleSink` over `Model`'s ``p<i>`` parameters) whose loader
raises after ``fail_after`` tensors of one call, having written those.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ascend_dist.weight_transfer._demo.procs import param_digests, synthetic_specs, synthetic_weights
from ascend_dist.weight_transfer.session import ModuleSink

SPECS = synthetic_specs(12, 40 * 1024, dtypes=("float32", "bfloat16"))
BUFFER = 8192  # the largest tensor is under 8 KiB, the model ~40 KiB: several chunks / buckets


class Model(torch.nn.Module):
    """One parameter per spec (flat names ``p<i>``) and a forward that reads them all."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        for i, (_, tensor) in enumerate(synthetic_weights(SPECS, seed)):
            self.register_parameter(f"p{i}", torch.nn.Parameter(tensor.clone(), requires_grad=False))

    def forward(self) -> torch.Tensor:
        return torch.stack([p.float().sum() for p in self.parameters()]).sum()


class FailingSink(ModuleSink):
    """`ModuleSink` over `Model`; its loader raises after ``fail_after`` tensors of one call, when set."""

    def __init__(self, module: Model, *, fail_after: int | None = None, restore: bool = True) -> None:
        super().__init__(module, restore=restore)  # restore off: no restore point (`ModuleSink.snapshot`)
        self.names = {name: f"p{i}" for i, (name, _, _) in enumerate(SPECS)}
        self.fail_after = fail_after

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        for i, (name, tensor) in enumerate(weights):
            if self.fail_after is not None and i == self.fail_after:
                raise KeyError(f"no parameter for {name!r}")  # after ``fail_after`` tensors were written
            loaded |= super().load_weights([(self.names[name], tensor)])
        return loaded


def digests(module: torch.nn.Module) -> dict[str, str]:
    """Each parameter's digest by name."""
    return param_digests(sorted(module.named_parameters()))


def want(seed: int) -> dict[str, str]:
    """The digests a `Model` holds after an update with ``seed``'s weights."""
    by_name = param_digests([(f"p{i}", t) for i, (_, t) in enumerate(synthetic_weights(SPECS, seed))])
    return dict(sorted(by_name.items()))
