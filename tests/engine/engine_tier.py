"""Helpers of the engine-tier tests: ports, prompts, output comparison."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence

from ascend_dist.cli.engines.wire import Completion, Prompt

__all__ = ["TP2_ENV", "assert_every_output_differs", "assert_same_output", "free_port_base", "local", "make_prompts"]

# TP 2 on this 2-core, one-NUMA-node machine: one core per worker (the automatic binding refuses two).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def free_port_base(count: int) -> int:
    """A base port with ``count`` consecutive free ports on 127.0.0.1 (P workers bind base + rank)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def make_prompts(seed: int, lengths: Sequence[int] = (45, 64, 200, 333)) -> list[list[int]]:
    """Token-id prompts, distinct per ``seed`` so that no engine's prefix cache answers for another test."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


def assert_same_output(got: Sequence[Completion], want: Sequence[Completion], *, atol: float = 2e-3) -> None:
    """Greedy tokens equal, logprobs within ``atol``, for every prompt."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.error is None, f"prompt {i}: {g.error}"
        assert g.token_ids == w.token_ids, f"prompt {i}: tokens {g.token_ids} != reference {w.token_ids}"
        worst = max((abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)), default=0.0)
        assert worst <= atol, f"prompt {i}: logprobs differ by {worst:.2e} (> {atol})"


def local(prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[Prompt]:
    return [Prompt(token_ids=list(p), max_tokens=max_tokens) for p in prompts]


def assert_every_output_differs(got: Sequence[Completion], want: Sequence[Completion]) -> None:
    """The control: with the producer on other weights, no D output may equal the reference's.

    One that does means D computed the prompt itself instead of using the transferred bytes.
    """
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.error is None, f"prompt {i}: {g.error}"
        assert g.token_ids != w.token_ids, f"prompt {i}: D's output equals the reference: it ignored the transfer"
