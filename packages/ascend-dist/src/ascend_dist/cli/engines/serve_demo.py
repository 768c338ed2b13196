"""`ascend-dist demo pd --serve`: the operator's path, P and D under ``vllm serve`` behind a proxy.

Runs in: the command's process; the servers run under the engine environment's Python
(``$ASCEND_DIST_ENGINE_PYTHON``). Writes two tiny Llamas (the served weights, and other weights
under the same name), starts a plain ``vllm serve`` (the reference), P and D with
`MooncakeConnectorV1` (``kv_producer`` / ``kv_consumer``), a P on the other weights, and one demo
proxy in front of each P (`serve_proxy`). It prints the exact commands, then checks D's answers
through the proxy, each read from P, against the reference (tokens and logprobs), the control (P
on other weights changes every answer of D), and our transfer stats on D's ``/metrics`` (bytes
moved > 0).
`start_pd`, `identity_rows` and `control_differs` are the engine tier's path too (``test_serve.py``).
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ascend_dist.cli.engines.host import EngineError, engine_python
from ascend_dist.cli.engines.serve import (
    MODEL_NAME,
    Server,
    ServeStack,
    complete,
    metric_total,
    transfer_stats_lines,
)
from ascend_dist.cli.engines.wire import Completion
from ascend_dist.cli.render import render_table
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.scenarios import Scenario, ScenarioContext, ScenarioReport

__all__ = [
    "ControlResult",
    "IdentityRow",
    "Measured",
    "PdServe",
    "PdServeScenario",
    "complete_measured",
    "complete_moved",
    "control_differs",
    "identity_rows",
    "serve_scenarios",
    "start_pd",
]

LOGPROB_ATOL = 2e-3
BYTES_METRIC = "vllm:mooncake_bytes_transferred_sum"
FAILED_METRIC = "vllm:mooncake_num_failed_transfers_total"


@dataclass(frozen=True)
class PdServe:
    """P and D, P on other weights (the control), and a proxy in front of each P."""

    p: Server
    d: Server
    p_other: Server
    proxy: Server
    proxy_other: Server


def start_pd(stack: ServeStack, model: Path, other_model: Path, *, also: Sequence[Server] = ()) -> PdServe:
    """Start P, D, the control's P and both proxies; wait for them (and for ``also``) to be healthy.

    Raises:
        EngineError: A server exited or was not healthy in time (its log's tail is in the message).
    """
    p = stack.start_vllm("prefill", model, role="kv_producer", engine_id="serve-p")
    d = stack.start_vllm("decode", model, role="kv_consumer", engine_id="serve-d")
    p_other = stack.start_vllm("prefill-other-weights", other_model, role="kv_producer", engine_id="serve-p-other")
    proxy = stack.start_proxy("proxy", p.url, d.url)
    proxy_other = stack.start_proxy("proxy-control", p_other.url, d.url)
    stack.wait_ready([proxy, proxy_other, *also, p, d, p_other], stack.start_timeout_s)
    return PdServe(p, d, p_other, proxy, proxy_other)


def prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Random token-id prompts of the given lengths (ids 1..499 of the tiny model's 512)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


@dataclass(frozen=True)
class IdentityRow:
    """One prompt of the identity check: D's answer through the proxy against the reference."""

    length: int
    same: bool
    """D's tokens and logprobs equal the reference's (within `LOGPROB_ATOL`)."""
    worst: float
    """The largest |dlogprob| between the two answers."""
    moved: bool
    """The answer compared came from a clean transfer (bytes moved, no failed load)."""
    recomputed: int
    """Tries whose transfer failed (D recomputed them on its own weights); every try when not `moved`."""

    @property
    def ok(self) -> bool:
        """Equal, and through a transfer: a recomputed answer is equal whatever the bytes were."""
        return self.same and self.moved


def identity_rows(
    reference: Callable[[list[int]], Completion], proxy: Server, d: Server, batch: Sequence[list[int]]
) -> list[IdentityRow]:
    """Per prompt: D's answer through ``proxy`` (`complete_moved`) against ``reference``'s."""
    rows = []
    for prompt in batch:
        want = reference(prompt)
        measured, failed = complete_moved(d, proxy, prompt)
        got = measured.completion
        worst = max((abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=False)), default=0.0)
        same = got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) and worst <= LOGPROB_ATOL
        rows.append(IdentityRow(len(prompt), same, worst, measured.moved_cleanly, failed))
    return rows


@dataclass(frozen=True)
class Measured:
    """One completion through a proxy, with what D's ``/metrics`` says the request moved."""

    completion: Completion
    bytes_moved: float
    failed_transfers: float

    @property
    def moved_cleanly(self) -> bool:
        """D read the request's KV from P: bytes moved and no load failed (not recomputed)."""
        return self.failed_transfers == 0 and self.bytes_moved > 0


def complete_measured(d: Server, proxy: Server, prompt: list[int], *, timeout_s: float = 30.0) -> Measured:
    """Complete ``prompt`` through ``proxy`` (one request at a time) and read D's transfer counters around it.

    vLLM records the stats after the step, so D's ``/metrics`` is polled until either counter moved
    (or ``timeout_s``: then both deltas are what they were, possibly zero).
    """
    before = d.metrics()
    moved0, failed0 = metric_total(before, BYTES_METRIC), metric_total(before, FAILED_METRIC)
    got = complete(proxy, prompt)
    deadline = time.monotonic() + timeout_s
    while True:
        text = d.metrics()
        moved, failed = metric_total(text, BYTES_METRIC) - moved0, metric_total(text, FAILED_METRIC) - failed0
        if moved > 0 or failed > 0 or time.monotonic() > deadline:
            return Measured(got, moved, failed)
        time.sleep(0.5)


def complete_moved(d: Server, proxy: Server, prompt: list[int], *, attempts: int = 3) -> tuple[Measured, int]:
    """``prompt`` through ``proxy`` until D read its KV from P without a failure: (that answer, failed tries).

    A request whose transfer failed was recomputed on D's own weights
    (``kv_load_failure_policy="recompute"``): its answer says nothing about the bytes, so it is
    sent again, at most ``attempts`` times in all. When no try moved cleanly the last try is
    returned (`Measured.moved_cleanly` is False).
    """
    measured = complete_measured(d, proxy, prompt)
    tries = 1
    while not measured.moved_cleanly and tries < attempts:
        measured = complete_measured(d, proxy, prompt)
        tries += 1
    return measured, tries if not measured.moved_cleanly else tries - 1


@dataclass(frozen=True)
class ControlResult:
    """How many prompts' answers differ from the reference, among answers whose KV came from P."""

    differ: int
    prompts: int
    recomputed: int
    """Requests whose transfer failed (D recomputed them, as configured) and were sent again."""
    unmoved: int = 0
    """Prompts with no clean transfer in any try: no verdict (counted as not differing)."""


def control_differs(
    reference: Callable[[list[int]], Completion], proxy_other: Server, d: Server, batch: Sequence[list[int]]
) -> ControlResult:
    """How many of D's answers through P on other weights differ from the reference (all must).

    Only an answer whose KV D read from P counts (`complete_moved`); a prompt without one counts
    as not differing.
    """
    differ = recomputed = unmoved = 0
    for prompt in batch:
        moved, failed = complete_moved(d, proxy_other, prompt)
        recomputed += failed
        unmoved += not moved.moved_cleanly
        differ += moved.moved_cleanly and moved.completion.token_ids != reference(prompt).token_ids
    return ControlResult(differ, len(batch), recomputed, unmoved)


def wait_transferred(d: Server, *, above: float = 0.0, timeout_s: float = 30.0) -> str:
    """D's /metrics once our bytes-transferred sum exceeds ``above`` (vLLM records stats after the step).

    Raises:
        EngineError: Not above ``above`` (or absent) after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        text = d.metrics()
        if metric_total(text, BYTES_METRIC) > above:
            return text
        if time.monotonic() > deadline:
            lines = "\n".join(transfer_stats_lines(text)) or "(no vllm:mooncake_* line at all)"
            raise EngineError(f"{d.name}: {BYTES_METRIC} is not above {above} after {timeout_s} s:\n{lines}")
        time.sleep(0.5)


def _write_models(python: str, root: Path) -> tuple[Path, Path]:
    paths = (root / "a" / MODEL_NAME, root / "b" / MODEL_NAME)
    for path, seed in zip(paths, (1, 2), strict=True):
        subprocess.run([python, "-m", "ascend_dist.cli.engines.model", str(path), "--seed", str(seed)],
                       check=True, capture_output=True, timeout=300)  # fmt: skip
    return paths


def _cache_root() -> Path:
    """The cache root of vLLM (``$VLLM_CACHE_ROOT``, else ``~/.cache/vllm``): its model inspection is kept."""
    if root := os.environ.get("VLLM_CACHE_ROOT"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"


def example_request(proxy: Server, prompt: Sequence[int]) -> str:
    """A curl line equivalent to one of the demo's requests."""
    body = {"model": MODEL_NAME, "prompt": list(prompt[:8]), "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    return shlex.join(["curl", "-s", f"{proxy.url}/v1/completions", "-H", "Content-Type: application/json",
                       "-d", json.dumps(body)])  # fmt: skip


@dataclass
class PdServeScenario:
    """The ``vllm serve`` walkthrough (demo only)."""

    name: str = "pd"
    summary: str = "vllm serve P and D (CPU build) with MooncakeConnectorV1 behind a proxy, vs a plain engine"
    modes: frozenset[str] = frozenset({"demo"})
    out: Callable[[str], None] = print

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Start everything, check, report; every process is stopped on the way out."""
        python = engine_python()
        if python is None:
            expected = "the engine environment's python (./dev demo pd --serve sets it)"
            raise ConfigError("ASCEND_DIST_ENGINE_PYTHON", None, expected)
        report = ScenarioReport(self.name, ctx.mode)
        workdir = Path(tempfile.mkdtemp(prefix="ascend-serve-"))
        ok = False
        try:
            ctx.progress.step("writing two tiny Llamas: the served weights and other weights under the same name")
            model, other = _write_models(python, workdir / "models")
            ctx.progress.step(
                f"starting vllm serve x4 and two proxies (logs in {workdir}; a fresh cache costs minutes)"
            )
            with ServeStack(python, workdir, _cache_root()) as stack:
                ref = stack.start_vllm("reference", model)
                pd = start_pd(stack, model, other, also=[ref])
                self.out("Commands (each runs in its own process group, on 127.0.0.1):\n" + "\n".join(stack.commands))
                self._check(ctx, report, ref, pd)
            ok = report.ok
        finally:
            if ok:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                self.out(f"logs kept in {workdir}")
        return report

    def _check(self, ctx: ScenarioContext, report: ScenarioReport, ref: Server, pd: PdServe) -> None:
        lengths = (64, 256) if ctx.quick else (64, 256, 512)
        batch = prompts(lengths, seed=1)
        self.out("Each request (greedy, to the proxy; P gets max_tokens=1 and do_remote_decode):\n"
                 + example_request(pd.proxy, batch[0]))  # fmt: skip
        ctx.progress.step("identity: D's answers through the proxy vs the plain engine")
        rows = identity_rows(lambda p: complete(ref, p), pd.proxy, pd.d, batch)
        for r in rows:
            report.check(f"{r.length}-token prompt: D's tokens and logprobs, read from P, equal the plain engine's",
                         r.ok, f"max |dlogprob| {r.worst:.1e}; {r.recomputed} transfer(s) failed and were "
                         f"recomputed (sent again){'' if r.moved else '; no try moved cleanly'}")  # fmt: skip
        self.out(render_table(("prompt tokens", "D == plain engine", "max |dlogprob|", "KV read from P"),
                              [(str(r.length), "yes" if r.same else "NO", f"{r.worst:.1e}",
                                "yes" if r.moved else "NO") for r in rows]))  # fmt: skip
        ctx.progress.step("control: the same prompts through P on other weights")
        control = control_differs(lambda p: complete(ref, p), pd.proxy_other, pd.d, prompts(lengths, seed=2))
        report.check("control: every D answer changes when P's weights differ", control.differ == len(lengths),
                     f"{control.differ}/{len(lengths)} differ; {control.recomputed} transfer(s) failed and "
                     f"were recomputed (sent again); {control.unmoved} prompt(s) never moved cleanly")  # fmt: skip
        ctx.progress.step(f"reading D's /metrics ({pd.d.url}/metrics)")
        try:
            text = wait_transferred(pd.d)
        except EngineError as exc:
            report.check("D's /metrics shows our transfer stats with bytes moved", False, str(exc))
            return
        lines = transfer_stats_lines(text)
        self.out("D's transfer stats (GET /metrics, vllm:mooncake_*):\n" + "\n".join(lines))
        report.check("D's /metrics shows our transfer stats with bytes moved", True,
                     f"{metric_total(text, BYTES_METRIC):.0f} bytes")  # fmt: skip


def serve_scenarios() -> tuple[dict[str, Scenario], dict[str, str]]:
    """The scenarios ``--serve`` runs (the same contract as the entry-point ones)."""
    scenario = PdServeScenario()
    return {scenario.name: scenario}, {}
