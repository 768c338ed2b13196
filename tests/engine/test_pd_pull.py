"""`MooncakeConnectorV1` between two real vLLM engines: D continues from P's KV cache, byte for byte.

Checks: D equals the no-connector reference; the control (P on other weights under the same name
changes every D output, so D really decoded P's bytes); P killed after its prefill -> D recomputes,
same output, within a deadline; `AscendMultiConnector` with a pull child in the same pair.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.pd import disaggregated_generate, pull_connector_config
from ascend_dist.cli.engines.wire import EngineSpec, Prompt
from ascend_dist.testing.engines import (
    assert_every_output_differs,
    assert_same_output,
    free_port_base,
    local,
    make_prompts,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

CONNECTOR = "MooncakeConnectorV1"
# D gives up on an unreachable P quickly, so the kill test finishes well inside its deadline.
FAST_FAILURE = {"rpc_timeout_s": 1.0, "rpc_retries": 2, "pull_timeout_s": 20.0}


def producer(host: EngineHost, model: Path, engine_id: str, name: str) -> Engine:
    config = pull_connector_config(CONNECTOR, "kv_producer", engine_id=engine_id, kv_port=free_port_base(1))
    return host.spawn(EngineSpec(model=str(model), kv_transfer_config=config), name)


@pytest.fixture(scope="module")
def pair(host: EngineHost, models: dict[str, Path]) -> tuple[Engine, Engine]:
    p = producer(host, models["a"], "pull-p", "pull-P")
    config = pull_connector_config(
        CONNECTOR, "kv_consumer", engine_id="pull-d", kv_port=free_port_base(1), extra=FAST_FAILURE
    )
    d = host.spawn(EngineSpec(model=str(models["a"]), kv_transfer_config=config), "pull-D")
    yield p, d
    p.close()
    d.close()


@pytest.fixture(scope="module")
def other(host: EngineHost, models: dict[str, Path]) -> Iterator[Engine]:
    """A P on the other weights: the control of every transfer checked here."""
    engine = producer(host, models["b"], "pull-p-other", "pull-P-other-weights")
    yield engine
    engine.close()


def test_decode_continues_from_prefill(pair: tuple[Engine, Engine], reference: Engine) -> None:
    p, d = pair
    prompts = make_prompts(101)
    out = disaggregated_generate(p, d, prompts)
    for r in out:
        assert r.prefill.kv_transfer_params is not None
        assert r.prefill.kv_transfer_params["do_remote_prefill"] is True
    assert_same_output([r.decode for r in out], reference.generate(local(prompts)))


def test_control_producer_on_other_weights_changes_every_output(
    pair: tuple[Engine, Engine], other: Engine, reference: Engine
) -> None:
    """The same D, fed by a P whose weights differ: if D used P's bytes, no output can match."""
    _, d = pair
    prompts = make_prompts(202)
    out = disaggregated_generate(other, d, prompts)
    assert_every_output_differs([r.decode for r in out], reference.generate(local(prompts)))


def test_prefill_killed_after_prefill_decode_recomputes(
    host: EngineHost, models: dict[str, Path], pair: tuple[Engine, Engine], other: Engine, reference: Engine
) -> None:
    _, d = pair
    doomed = producer(host, models["a"], "pull-p-doomed", "pull-P-killed")
    prompts = make_prompts(303)
    first = doomed.generate(
        [Prompt(token_ids=p, max_tokens=1, kv_transfer_params={"do_remote_decode": True}) for p in prompts]
    )
    doomed.kill()
    start = time.monotonic()
    got = d.generate(
        [
            Prompt(token_ids=p, max_tokens=8, kv_transfer_params=c.kv_transfer_params)
            for p, c in zip(prompts, first, strict=True)
        ],
        timeout_s=90,
    )
    elapsed = time.monotonic() - start
    assert_same_output(got, reference.generate(local(prompts)))
    assert elapsed < 60, f"D took {elapsed:.1f} s to give up on a dead P"
    # D still transfers from a live P afterwards (not only recomputes): the live pair equals the
    # reference, and the control P on other weights changes D's output for the same prompts.
    again = make_prompts(304, (100,))
    want = reference.generate(local(again))
    assert_same_output([r.decode for r in disaggregated_generate(pair[0], d, again)], want)
    again = make_prompts(305, (100,))
    want = reference.generate(local(again))
    assert_every_output_differs([r.decode for r in disaggregated_generate(other, d, again)], want)


def test_multi_connector_with_a_pull_child(
    host: EngineHost, models: dict[str, Path], pair: tuple[Engine, Engine], reference: Engine
) -> None:
    """D as `AscendMultiConnector` [pull consumer, recompute offload]: the pull child loads from the same P."""
    p, _ = pair
    pull_child = pull_connector_config(
        CONNECTOR, "kv_consumer", engine_id="multi-d", kv_port=free_port_base(1), extra=FAST_FAILURE
    )
    del pull_child["engine_id"]  # vLLM's MultiConnector hands every child the parent's engine_id
    config = {
        "kv_connector": "AscendMultiConnector",
        "kv_role": "kv_consumer",
        "engine_id": "multi-d",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "connectors": [
                pull_child,
                {"kv_connector": "RecomputeCPUOffloadConnector", "kv_role": "kv_both"},
            ]
        },
    }
    d = host.spawn(EngineSpec(model=str(models["a"]), kv_transfer_config=config), "multi-D")
    try:
        prompts = make_prompts(404)
        out = disaggregated_generate(p, d, prompts)
        assert_same_output([r.decode for r in out], reference.generate(local(prompts)))
        other = producer(host, models["b"], "multi-p-other", "multi-P-other-weights")
        try:
            prompts = make_prompts(405)
            out = disaggregated_generate(other, d, prompts)
            assert_every_output_differs([r.decode for r in out], reference.generate(local(prompts)))
        finally:
            other.close()
    finally:
        d.close()
