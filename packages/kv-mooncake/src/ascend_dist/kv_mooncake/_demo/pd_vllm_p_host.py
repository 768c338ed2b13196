"""Where the ``pd-vllm`` bench's P runs: beside D in the bench's process, or in a process of its own.

Runs in: the ``ascend-dist bench`` process. `PHost` is what a wave asks of P; the in-process host is
`pd_vllm_driver.Instance` itself (D's loop steps it in turn), `ProcessP` drives a child
(`pd_vllm_p_child`) whose main thread is P's engine loop, as in a deployment where P and D are two
``vllm serve`` processes: each process then has its own interpreter lock, so a side-channel reply
on P never waits for D's Python and the other way round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from ascend_dist.kv_mooncake._demo.pd_vllm_geometry import Shape
from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess, free_port_range

__all__ = ["PHost", "ProcessP"]

CHILD_MODULE = "ascend_dist.kv_mooncake._demo.pd_vllm_p_child"
START_TIMEOUT_S = 180.0  # the child imports vLLM and builds P's connector and scheduler
REPLY_MARGIN_S = 30.0  # beyond a command's own deadline: the child's digests, the pipe


class PHost(Protocol):
    """What a wave asks of P (see the bench's module docstring)."""

    def fill_random(self, seed: int) -> None:
        """Every cache byte from a seeded generator."""
        ...

    def prefill(
        self, req_ids: Sequence[str], prompts: Sequence[list[int]], params: Sequence[dict[str, Any]], timeout_s: float
    ) -> tuple[dict[str, list[int]], dict[str, dict[str, Any] | None]]:
        """Compute the prompts as P; each request's blocks and returned params."""
        ...

    def digests(self, blocks: Mapping[str, Sequence[int]]) -> dict[str, list[str]]:
        """Per request, a digest of each of its blocks' prompt tokens."""
        ...

    def step_beside(self) -> None:
        """Called by D's loop between its steps: a P of the same process steps here."""
        ...

    def wait_idle(self, timeout_s: float) -> None:
        """Return once P's scheduler has no work (every lent block back)."""
        ...

    def close(self) -> None:
        """Shut P down."""
        ...


class ProcessP:
    """P in a child process: vLLM's ``Scheduler`` and a factory-built worker connector, its engine loop its own."""

    def __init__(self, model_dir: Path, shape: Shape, transfer: Mapping[str, Any], env: Mapping[str, str]) -> None:
        """Start the child and build P there (``transfer``: the ``KVTransferConfig`` fields; ``env``: set in it)."""
        self._peer = PeerProcess(module=CHILD_MODULE, ready_timeout_s=START_TIMEOUT_S)
        try:
            self._peer.call(
                {
                    "cmd": "start",
                    "model_dir": str(model_dir),
                    "shape": dataclasses.asdict(shape),
                    "transfer": dict(transfer),
                    "env": dict(env),
                    "gloo_port": free_port_range(1),
                },
                timeout_s=START_TIMEOUT_S,
            )
        except BaseException:
            self._peer.close()
            raise

    def fill_random(self, seed: int) -> None:
        self._peer.call({"cmd": "fill", "seed": seed}, timeout_s=REPLY_MARGIN_S)

    def prefill(
        self, req_ids: Sequence[str], prompts: Sequence[list[int]], params: Sequence[dict[str, Any]], timeout_s: float
    ) -> tuple[dict[str, list[int]], dict[str, dict[str, Any] | None]]:
        reply = self._peer.call(
            {
                "cmd": "prefill",
                "req_ids": list(req_ids),
                "prompts": list(prompts),
                "params": list(params),
                "timeout_s": timeout_s,
            },
            timeout_s=timeout_s + REPLY_MARGIN_S,
        )
        return reply["blocks"], reply["params"]

    def digests(self, blocks: Mapping[str, Sequence[int]]) -> dict[str, list[str]]:
        reply = self._peer.call(
            {"cmd": "digests", "blocks": {k: list(v) for k, v in blocks.items()}}, timeout_s=REPLY_MARGIN_S
        )
        return reply["digests"]

    def step_beside(self) -> None:
        """Nothing: the child's own loop steps P."""

    def wait_idle(self, timeout_s: float) -> None:
        self._peer.call({"cmd": "idle", "timeout_s": timeout_s}, timeout_s=timeout_s + REPLY_MARGIN_S)

    def close(self) -> None:
        """Ask the child to shut P down and leave (then terminate or kill it)."""
        self._peer.close(timeout_s=REPLY_MARGIN_S)
