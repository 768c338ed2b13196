"""`ascend-dist demo pd --engine vllm`: two real vLLM engines exchange prompts through `MooncakeConnectorV1`.

Runs in: the command's process; the engines run under the engine environment's Python
(``$ASCEND_DIST_ENGINE_PYTHON``, which ``./dev`` sets after building it). Writes a tiny random-weight
Llama, starts a reference engine (no connector), P and D, then per prompt: D's greedy tokens and
logprobs against the reference, and D's time to first token through the transfer next to the
reference recomputing a fresh prompt of the same length. The control runs P on other weights under
the same model name: every D output must then differ.
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ascend_dist.cli.engines.host import Engine, EngineHost, engine_python
from ascend_dist.cli.engines.pd import disaggregated_generate, pull_connector_config
from ascend_dist.cli.engines.wire import EngineSpec, Prompt
from ascend_dist.cli.render import render_table
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.scenarios import Measurement, Scenario, ScenarioContext, ScenarioReport

__all__ = ["PdEngineScenario", "engine_scenarios"]

LOGPROB_ATOL = 2e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(n)]


@dataclass
class PdEngineScenario:
    """The real-engine P/D demo (and its TTFT figures in bench mode)."""

    name: str = "pd"
    summary: str = "two real vLLM engines (CPU build): D continues from P's KV cache via MooncakeConnectorV1"
    modes: frozenset[str] = frozenset({"demo", "bench"})
    out: Callable[[str], None] = print

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Start the engines, run the prompts, report; every engine is closed on the way out."""
        python = engine_python()
        if python is None:
            raise ConfigError(
                "ASCEND_DIST_ENGINE_PYTHON",
                None,
                "the engine environment's python (./dev demo pd --engine vllm sets it)",
            )
        report = ScenarioReport(self.name, ctx.mode)
        lengths = (64, 256) if ctx.quick else (64, 256, 512, 900)
        ctx.progress.step(f"starting the zygote under {python} (imports vLLM once)")
        with EngineHost(python) as host:
            ctx.progress.step("writing two tiny Llamas: the served weights and other weights under the same name")
            model = host.write_model(host.workdir / "a" / "tiny", seed=1)
            other_model = host.write_model(host.workdir / "b" / "tiny", seed=2)
            ctx.progress.step("starting the reference engine (no connector), P and D")
            reference = host.spawn(EngineSpec(model=str(model), max_model_len=2048), "reference")
            p = self._side(host, str(model), "kv_producer", "demo-p")
            d = self._side(host, str(model), "kv_consumer", "demo-d")
            rows = self._identity(ctx, report, (reference, p, d), lengths)
            self.out(
                render_table(
                    ("prompt tokens", "D == reference", "max |dlogprob|", "TTFT via P", "TTFT recompute"), rows
                )
            )
            ctx.progress.step("control: P on other weights under the same name")
            other = self._side(host, str(other_model), "kv_producer", "demo-p-other")
            rng = random.Random(7)
            prompts = [_prompt(rng, n) for n in lengths]
            want = reference.generate([Prompt(token_ids=x) for x in prompts])
            got = disaggregated_generate(other, d, prompts)
            differ = sum(g.decode.token_ids != w.token_ids for g, w in zip(got, want, strict=True))
            report.check("control: every D output changes when P's weights differ", differ == len(prompts),
                         f"{differ}/{len(prompts)} differ")  # fmt: skip
        return report

    @staticmethod
    def _side(host: EngineHost, model: str, role: str, engine_id: str) -> Engine:
        config = pull_connector_config("MooncakeConnectorV1", role, engine_id=engine_id, kv_port=_free_port())
        return host.spawn(EngineSpec(model=model, max_model_len=2048, kv_transfer_config=config), engine_id)

    @staticmethod
    def _identity(
        ctx: ScenarioContext,
        report: ScenarioReport,
        engines: tuple[Engine, Engine, Engine],
        lengths: tuple[int, ...],
    ) -> list[tuple[str, ...]]:
        """Per prompt length: identity with the reference, and TTFT via P vs recomputing (reference, P, D)."""
        reference, p, d = engines
        rng = random.Random(1)
        rows = []
        for i, n in enumerate(lengths):
            ctx.progress.advance(i, len(lengths))
            prompt = _prompt(rng, n)
            want = reference.generate([Prompt(token_ids=prompt)])[0]
            got = disaggregated_generate(p, d, [prompt])[0].decode
            worst = max((abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=False)), default=0.0)
            same = got.token_ids == want.token_ids and worst <= LOGPROB_ATOL
            report.check(f"{n}-token prompt: D's tokens and logprobs equal the reference", same,
                         f"max |dlogprob| {worst:.1e}")  # fmt: skip
            # Time to first token on fresh prompts: D through the transfer vs the reference computing it.
            fresh_d, fresh_r = _prompt(rng, n), _prompt(rng, n)
            params = p.generate(
                [Prompt(token_ids=fresh_d, max_tokens=1, kv_transfer_params={"do_remote_decode": True})]
            )
            start = time.perf_counter()
            d.generate([Prompt(token_ids=fresh_d, max_tokens=1, kv_transfer_params=params[0].kv_transfer_params)])
            via_p = time.perf_counter() - start
            start = time.perf_counter()
            reference.generate([Prompt(token_ids=fresh_r, max_tokens=1)])
            recompute = time.perf_counter() - start
            report.measurements.append(
                Measurement(
                    f"D's TTFT, {n}-token prompt",
                    via_p,
                    "s",
                    recompute,
                    "reference recomputing it",
                    higher_is_better=False,
                )
            )
            rows.append(
                (str(n), "yes" if same else "NO", f"{worst:.1e}", f"{via_p * 1e3:.1f} ms", f"{recompute * 1e3:.1f} ms")
            )
        ctx.progress.advance(len(lengths), len(lengths))
        return rows


def engine_scenarios() -> tuple[dict[str, Scenario], dict[str, str]]:
    """The scenarios `--engine vllm` runs (the same contract as the entry-point ones)."""
    scenario = PdEngineScenario()
    return {scenario.name: scenario}, {}
