"""`AscendMultiConnector` composing P/D pull (`MooncakeConnectorV1`) with the KV pool (`AscendStoreConnector`).

P and D are each an `AscendMultiConnector` [pull, pool] over a real ``mooncake_master``: P prefills
and pools the prompt's chunks, D pulls P's KV cache (the pull child answers first). Checks: D
equals the no-connector reference; the control (P on model "b" changes every D output); D loaded
every prompt token but the last from P, more than the pool could give (whole chunks only), so the
pull child answered; and the pool child really stored: a third engine, a plain pool engine, hits
every full chunk P pooled and equals the reference — and the chunks P on "b" pooled change every
one of its outputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.pd import Disaggregated, disaggregated_generate, pull_connector_config
from ascend_dist.cli.engines.wire import Completion, EngineSpec
from ascend_dist.kv_store.master_process import MasterProcess
from ascend_dist.testing.engines import (
    POOL_LENGTHS,
    assert_every_output_differs,
    assert_same_output,
    expected_hits,
    free_port_base,
    full_chunks,
    local,
    make_prompts,
    master_key_count,
    master_metric,
    mooncake_store_config,
    pool_config,
    wait_for_keys,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

PULL = "MooncakeConnectorV1"


def multi_config(role: str, engine_id: str, master: MasterProcess) -> dict[str, Any]:
    """[pull child of ``role``, pool child]; ``engine_id`` only on the parent (vLLM hands it to the children)."""
    pull = pull_connector_config(PULL, role, engine_id=engine_id, kv_port=free_port_base(1))
    del pull["engine_id"]
    pool = pool_config("mooncake", mooncake_store_config(master.address))
    return {
        "kv_connector": "AscendMultiConnector",
        "kv_role": role,
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [pull, pool]},
    }


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    proc = MasterProcess(log_path=tmp_path_factory.mktemp("mooncake-multi") / "master.log")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def engines(host: EngineHost, models: dict[str, Path], master: MasterProcess) -> Iterator[dict[str, Engine]]:
    """P on "a" and on "b", D, and a plain pool engine ("pool") on "a" that reads what the Ps pooled."""
    spawned: dict[str, Engine] = {}
    try:
        for name, model, role in (("p", "a", "kv_producer"), ("p-b", "b", "kv_producer"), ("d", "a", "kv_consumer")):
            config = multi_config(role, f"multi-pool-{name}", master)
            spawned[name] = host.spawn(EngineSpec(model=str(models[model]), kv_transfer_config=config), f"multi-{name}")
        pool = pool_config("mooncake", mooncake_store_config(master.address))
        spawned["pool"] = host.spawn(EngineSpec(model=str(models["a"]), kv_transfer_config=pool), "multi-pool-reader")
        yield spawned
    finally:
        for engine in spawned.values():
            engine.close()


def pool_reads(master: MasterProcess) -> int:
    """Objects read from the pool so far: every pool load asks the master where its objects are."""
    return master_metric(master, "master_batch_get_replica_list_items_total") + master_metric(
        master, "master_get_replica_list_requests_total"
    )


def pd_through_multi(p: Engine, d: Engine, master: MasterProcess, prompts: list[list[int]]) -> list[Disaggregated]:
    """P then D, each as a multi-connector; returns once P's pool child stored every full chunk.

    D's KV comes from P by the pull child, not from the pool: the master serves no read meanwhile.
    (vLLM 0.32 reports P's cache hits as D's ``num_cached_tokens``, so that counter cannot tell.)
    """
    want = master_key_count(master) + full_chunks(prompts)
    reads = pool_reads(master)
    out = disaggregated_generate(p, d, prompts)
    for r in out:
        assert r.prefill.num_cached_tokens == 0, "P hit a pool that should not hold these prompts"
        assert r.prefill.kv_transfer_params is not None
        assert r.prefill.kv_transfer_params["do_remote_prefill"] is True
    assert pool_reads(master) == reads, "D (or P) read from the pool: the pull child did not answer"
    wait_for_keys(master, want)
    return out


def read_through_pool(engine: Engine, master: MasterProcess, prompts: list[list[int]]) -> list[Completion]:
    """A plain pool engine runs ``prompts``: every full chunk loaded, each one read from the master's pool."""
    reads = pool_reads(master)
    read = engine.generate(local(prompts))
    assert [c.num_cached_tokens for c in read] == expected_hits(prompts)
    assert pool_reads(master) - reads >= full_chunks(prompts)
    return read


def test_decode_pulls_and_prefill_pools(engines: dict[str, Engine], master: MasterProcess, reference: Engine) -> None:
    prompts = make_prompts(1801, POOL_LENGTHS)
    out = pd_through_multi(engines["p"], engines["d"], master, prompts)
    want = reference.generate(local(prompts))
    assert_same_output([r.decode for r in out], want)
    # The pool child of P stored the prompts: an engine that never saw them loads every full chunk.
    read = read_through_pool(engines["pool"], master, prompts)
    assert_same_output(read, want)


def test_control_prefill_on_other_weights(engines: dict[str, Engine], master: MasterProcess, reference: Engine) -> None:
    """P on "b": D decoded P's bytes, and the pool reader decodes the chunks P pooled (every output changes)."""
    prompts = make_prompts(1802, POOL_LENGTHS)
    out = pd_through_multi(engines["p-b"], engines["d"], master, prompts)
    want = reference.generate(local(prompts))
    assert_every_output_differs([r.decode for r in out], want)
    read = read_through_pool(engines["pool"], master, prompts)
    assert_every_output_differs(read, want)
