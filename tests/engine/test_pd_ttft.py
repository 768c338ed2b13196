"""D's time to first token through the transfer: `MooncakeConnectorV1` beside vLLM's `NixlConnector`.

Same model, engine settings and prompts for both pairs. P prefills every prompt; then D answers each
prompt alone with one token, so the wall time of that call is D's time to first token through the
transfer (scheduling, the pull, one forward of the last prompt token). A plain engine's time for the
same prompts (the whole prefill, no transfer) is printed beside them.

Both D engines run with ``kv_load_failure_policy="fail"``: a load that failed ends the request with an
error instead of recomputing it, so a figure can never be a recompute's time passed off as a transfer's.
Each D's token must equal the plain engine's. Figures go to the engine tier's report (printed at the
end of the run); they are not asserted: timings on a shared 2-core machine are not a pass criterion.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.pd import pull_connector_config
from ascend_dist.cli.engines.wire import Completion, EngineSpec, Prompt
from ascend_dist.testing.engines import free_port_base, make_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

# Long enough that the transfer is a visible part of the time (the model allows 1,024 tokens).
LENGTHS = (600, 700, 800, 900)
ROUNDS = 2  # each prompt set is timed this many times (fresh prompts each round: no prefix-cache hit)


def _nixl_config(port: int) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's NixlConnector on the CPU build (host buffers), its side channel on 127.0.0.1:``port``."""
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
    }
    return config, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}


def _ours_config(role: str, engine_id: str) -> dict[str, Any]:
    config = pull_connector_config("MooncakeConnectorV1", role, engine_id=engine_id, kv_port=free_port_base(1))
    config["kv_load_failure_policy"] = "fail"
    return config


@pytest.fixture(scope="module")
def nixl_pair(host: EngineHost, models: dict[str, Path]) -> Iterator[tuple[Engine, Engine]]:
    model = str(models["a"])
    p_config, p_env = _nixl_config(free_port_base(1))
    d_config, d_env = _nixl_config(free_port_base(1))
    p = host.spawn(EngineSpec(model=model, kv_transfer_config=p_config, env=p_env), "nixl-P")
    d = host.spawn(EngineSpec(model=model, kv_transfer_config=d_config, env=d_env), "nixl-D")
    yield p, d
    p.close()
    d.close()


@pytest.fixture(scope="module")
def ours_pair(host: EngineHost, models: dict[str, Path]) -> Iterator[tuple[Engine, Engine]]:
    model = str(models["a"])
    p = host.spawn(EngineSpec(model=model, kv_transfer_config=_ours_config("kv_producer", "ttft-p")), "ttft-P")
    d = host.spawn(EngineSpec(model=model, kv_transfer_config=_ours_config("kv_consumer", "ttft-d")), "ttft-D")
    yield p, d
    p.close()
    d.close()


def _ttft_through(p: Engine, d: Engine, prompts: list[list[int]]) -> tuple[list[float], list[Completion]]:
    """P prefills all of ``prompts`` in one batch; D then answers each alone with one token (timed)."""
    first = p.generate(
        [Prompt(token_ids=q, max_tokens=1, kv_transfer_params={"do_remote_decode": True}) for q in prompts]
    )
    seconds, answers = [], []
    for i, (q, c) in enumerate(zip(prompts, first, strict=True)):
        assert c.error is None and c.kv_transfer_params, f"{p.name} gave prompt {i} no transfer params ({c.error})"
        timed = d.generate_timed([Prompt(token_ids=q, max_tokens=1, kv_transfer_params=c.kv_transfer_params)])
        (answer,) = timed.completions
        assert answer.error is None, f"{d.name}: prompt {i} failed its load ({answer.error}): no figure"
        seconds.append(timed.seconds)
        answers.append(answer)
    return seconds, answers


def _plain(reference: Engine, prompts: list[list[int]]) -> tuple[list[float], list[Completion]]:
    seconds, answers = [], []
    for q in prompts:
        timed = reference.generate_timed([Prompt(token_ids=q, max_tokens=1)])
        seconds.append(timed.seconds)
        answers.extend(timed.completions)
    return seconds, answers


def test_ttft_through_the_transfer_beside_nixl(
    ours_pair: tuple[Engine, Engine],
    nixl_pair: tuple[Engine, Engine],
    reference: Engine,
    engine_report: Callable[[str], None],
) -> None:
    times: dict[str, list[float]] = {"ours": [], "nixl": [], "plain": []}
    for r in range(ROUNDS):
        # The same fresh prompts for all three in each round (their engines share no cache; the
        # plain engine sees them last, so neither pair's P can have warmed it).
        prompts = make_prompts(7100 + r, LENGTHS)
        ours_s, ours = _ttft_through(*ours_pair, prompts)
        nixl_s, nixl = _ttft_through(*nixl_pair, prompts)
        plain_s, plain = _plain(reference, prompts)
        for i, want in enumerate(plain):
            assert want.error is None and want.token_ids, f"the plain engine has no token for prompt {i}"
            for name, got in (("ours", ours[i]), ("nixl", nixl[i])):
                assert got.token_ids == want.token_ids, f"{name}: prompt {i} {got.token_ids} != {want.token_ids}"
        times["ours"] += ours_s
        times["nixl"] += nixl_s
        times["plain"] += plain_s
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    engine_report(
        f"TTFT on D, prompts of {min(LENGTHS)}-{max(LENGTHS)} tokens, {len(times['ours'])} each, median: "
        f"MooncakeConnectorV1 {med['ours']:.0f} ms, vLLM's NixlConnector {med['nixl']:.0f} ms "
        f"(ours / NIXL {med['ours'] / med['nixl']:.2f}x), plain prefill {med['plain']:.0f} ms"
    )
