"""The engine tier's harness: prompts, output comparison, and the pool checks several test files share.

Runs in the engine environment (vLLM's CPU build), where the meta-package's ``ascend_dist.cli.engines``
and the store's ``MasterProcess`` are installed. Both are imported for type hints or inside the one
function that needs them, so the pure helpers import anywhere.
"""

from __future__ import annotations

import random
import re
import time
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ascend_dist.testing.ports import free_port_base

if TYPE_CHECKING:
    from ascend_dist.cli.engines.wire import Completion, Prompt
    from ascend_dist.kv_store.master_process import MasterProcess

__all__ = [
    "POOL_BLOCK",
    "POOL_LENGTHS",
    "SAVE_DEADLINE_S",
    "TP2_ENV",
    "assert_every_output_differs",
    "assert_same_output",
    "expected_hits",
    "free_port_base",
    "full_chunks",
    "local",
    "make_prompts",
    "master_key_count",
    "master_metric",
    "mooncake_store_config",
    "pool_config",
    "wait_for_keys",
]

# TP 2 on a 2-core, one-NUMA-node machine: one core per worker (the automatic binding refuses two).
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

POOL_BLOCK = 32
"""``EngineSpec``'s block size, which is also one pool chunk."""
POOL_LENGTHS = (45, 100, 140)
"""Prompt lengths of a few chunks each, none a whole multiple of the block (a full hit reports one token less)."""
SAVE_DEADLINE_S = 60.0


def make_prompts(seed: int, lengths: Sequence[int] = (45, 64, 200, 333)) -> list[list[int]]:
    """Token-id prompts, distinct per ``seed`` so that no engine's prefix cache answers for another test."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


def local(prompts: Sequence[Sequence[int]], max_tokens: int = 8) -> list[Prompt]:
    """``prompts`` as engine requests of ``max_tokens`` each, without transfer params."""
    from ascend_dist.cli.engines.wire import Prompt

    return [Prompt(token_ids=list(p), max_tokens=max_tokens) for p in prompts]


def assert_same_output(got: Sequence[Completion], want: Sequence[Completion], *, atol: float = 2e-3) -> None:
    """Greedy tokens equal, logprobs within ``atol``, for every prompt; the reference must have answered.

    An empty or failed reference would make any empty answer "equal": refused.
    """
    assert want, "no reference outputs: the comparison proves nothing"
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert w.error is None and w.token_ids, f"prompt {i}: the reference has no tokens ({w.error})"
        assert g.error is None, f"prompt {i}: {g.error}"
        assert g.token_ids == w.token_ids, f"prompt {i}: tokens {g.token_ids} != reference {w.token_ids}"
        worst = max((abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)), default=0.0)
        assert worst <= atol, f"prompt {i}: logprobs differ by {worst:.2e} (> {atol})"


def assert_every_output_differs(got: Sequence[Completion], want: Sequence[Completion]) -> None:
    """The control: with the producer on other weights, no D output may equal the reference's.

    One that does means D computed the prompt itself instead of using the transferred bytes. Both
    outputs must be full answers of the same length: an empty, failed or cut-short output "differs"
    without proving that the transferred bytes were used, so it is refused.
    """
    assert want, "no reference outputs: the control proves nothing"
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert w.error is None and w.token_ids, f"prompt {i}: the reference has no tokens ({w.error})"
        assert g.error is None, f"prompt {i}: {g.error}"
        assert len(g.token_ids) == len(w.token_ids), (
            f"prompt {i}: {len(g.token_ids)} tokens against the reference's {len(w.token_ids)}: "
            "a short answer differs without proving anything"
        )
        assert g.token_ids != w.token_ids, f"prompt {i}: D's output equals the reference: it ignored the transfer"


# ---- pool engines (AscendStoreConnector over a shared store) ------------------------------------


def pool_config(store: str, store_config: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The ``kv_transfer_config`` of a pool engine (saves and loads) over ``store`` ("mooncake"/"yuanrong").

    ``kv_load_failure_policy="recompute"``: vLLM 0.32 would fail a request whose load failed.
    """
    return {
        "kv_connector": "AscendStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"backend": store, "store_config": store_config, **extra},
    }


def mooncake_store_config(address: str) -> dict[str, Any]:
    """Mooncake client settings for a master on loopback (each engine lends a small segment)."""
    return {
        "master_server_address": address,
        "metadata_server": "P2PHANDSHAKE",
        "protocol": "tcp",
        "local_hostname": "127.0.0.1",
        "global_segment_size": "64MB",
        "local_buffer_size": "16MB",
    }


def full_chunks(prompts: Sequence[Sequence[int]]) -> int:
    """Full `POOL_BLOCK` chunks over all ``prompts``: the objects a writer pools (per layer when layer-wise)."""
    return sum(len(p) // POOL_BLOCK for p in prompts)


def expected_hits(prompts: Sequence[Sequence[int]]) -> list[int]:
    """The tokens a reader loads from the pool: every full chunk of each prompt."""
    return [len(p) // POOL_BLOCK * POOL_BLOCK for p in prompts]


def master_metric(master: MasterProcess, name: str) -> int:
    """One counter or gauge from the master's Prometheus endpoint."""
    url = f"http://127.0.0.1:{master.metrics_port}/metrics"
    status = master.exit_status()
    if status is not None:  # say why instead of "connection refused"
        raise AssertionError(f"mooncake_master exited with {status}; its log ends:\n{master.log_tail()}")
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(rf"^{re.escape(name)} (\d+)", text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"no {name} in {url}")
    return int(match.group(1))


def master_key_count(master: MasterProcess) -> int:
    """Objects the master holds now."""
    return master_metric(master, "master_key_count")


def wait_for_keys(master: MasterProcess, at_least: int, timeout_s: float = SAVE_DEADLINE_S) -> float:
    """Wait until the master holds ``at_least`` objects; the seconds waited.

    A request finishes before its background save: without this wait the reader's lookup could
    race the writer's put and see a shorter hit.
    """
    start = time.monotonic()
    while (have := master_key_count(master)) < at_least:
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"the master holds {have} objects after {timeout_s} s, expected {at_least}")
        time.sleep(0.1)
    return time.monotonic() - start
