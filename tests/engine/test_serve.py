"""The operator's path: P and D under ``vllm serve`` with `MooncakeConnectorV1`, behind the demo proxy.

The same path as ``./dev demo pd --serve`` (`ascend_dist.cli.engines.serve_demo`): OpenAI completions
(greedy) to the proxy, which sends each to P with ``max_tokens=1`` and ``do_remote_decode`` and hands
P's ``kv_transfer_params`` to D. Checks: D's answers, each read from P, equal the session's plain
engine (tokens and logprobs); the control (the proxy in front of P on other weights) changes every
answer; and D's ``/metrics`` carries our transfer stats, moved by a request (bytes > 0, no failure
of its own). A transfer that fails is recomputed on D (as configured), and that answer proves
nothing about the bytes (it equals the plain engine's whatever P sent): every check sends such a
prompt again, three tries in all, and counts only answers read from P. Three
``vllm serve`` starts for the module (P, D, the control's P); the plain engine is the session's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ascend_dist.cli.engines.host import Engine
from ascend_dist.cli.engines.serve import ServeStack, metric_total
from ascend_dist.cli.engines.serve_demo import (
    BYTES_METRIC,
    PdServe,
    complete_moved,
    control_differs,
    identity_rows,
    prompts,
    start_pd,
    wait_transferred,
)
from ascend_dist.cli.engines.wire import Completion, Prompt

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

LENGTHS = (64, 256)


@pytest.fixture(scope="module")
def served(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdServe]:
    # vLLM's model inspection is cached under VLLM_CACHE_ROOT: a fresh root costs minutes per start.
    cache = Path(os.environ.get("VLLM_CACHE_ROOT") or Path.home() / ".cache" / "vllm")
    with ServeStack(sys.executable, tmp_path_factory.mktemp("serve"), cache) as stack:
        yield start_pd(stack, models["a"], models["b"])


def _plain(reference: Engine) -> Callable[[list[int]], Completion]:
    return lambda p: reference.generate([Prompt(token_ids=p, max_tokens=8)])[0]


def test_d_through_the_proxy_answers_like_the_plain_engine(served: PdServe, reference: Engine) -> None:
    rows = identity_rows(_plain(reference), served.proxy, served.d, prompts(LENGTHS, seed=1))
    print(f"identity: {sum(r.recomputed for r in rows)} transfer(s) failed, recomputed and sent again")
    # A recomputed answer equals the plain engine's whatever P sent: only answers read from P count.
    assert all(r.ok for r in rows), rows


def test_control_p_on_other_weights_changes_every_answer(served: PdServe, reference: Engine) -> None:
    batch = prompts(LENGTHS, seed=2)
    control = control_differs(_plain(reference), served.proxy_other, served.d, batch)
    # A request whose transfer failed was recomputed on D's weights and is sent again (counted, said here).
    print(f"control: {control.differ}/{control.prompts} differ, {control.recomputed} recomputed and sent again")
    # A prompt with no clean transfer in its tries leaves the control without a verdict: say why.
    why = "\n".join(
        f"{s.name}: {s.matching('ERROR', 'WARNING', 'failed')}" for s in (served.d, served.p_other, served.proxy_other)
    )
    assert control.differ == len(batch), f"{control}\n{why}"


def test_ds_metrics_carry_our_transfer_stats_moved_by_a_request(served: PdServe) -> None:
    before = metric_total(served.d.metrics(), BYTES_METRIC)
    moved, recomputed = complete_moved(served.d, served.proxy, prompts((128,), seed=3)[0])
    print(f"metrics: {recomputed} transfer(s) failed, recomputed and sent again")
    assert moved.moved_cleanly  # its own bytes, counted, and no failed load
    text = wait_transferred(served.d, above=before)  # the control: a request moved bytes
    assert metric_total(text, "vllm:mooncake_bytes_transferred_count") > 0
    assert metric_total(text, "vllm:mooncake_xfer_time_seconds_count") > 0
