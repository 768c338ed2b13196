"""No client can crash an engine: hostile ``kv_transfer_params`` between good requests, on D and on P.

Each batch is [good, hostile, good] through a real pull pair: the good requests still decode from
P's KV cache (their output equals the reference), the hostile one is computed locally (its output
equals the reference too), the engine serves the next batch, and D's log names the bad key.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.pd import disaggregated_generate, pull_connector_config
from ascend_dist.cli.engines.wire import EngineSpec, Prompt
from ascend_dist.testing.engines import assert_same_output, free_port_base, local, make_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CONNECTOR = "MooncakeConnectorV1"
FAST_FAILURE = {"rpc_timeout_s": 1.0, "rpc_retries": 2, "pull_timeout_s": 20.0}

Params = dict[str, Any]


def _set(key: str, value: Any) -> Callable[[Params], Params]:
    def apply(good: Params) -> Params:
        bad = copy.deepcopy(good)
        bad[key] = value
        return bad

    return apply


# Each kind of garbage, made from a good request's params (so everything else is valid).
HOSTILE: dict[str, Callable[[Params], Params]] = {
    "port-not-an-int": _set("remote_port", "abc"),
    "port-out-of-range": _set("remote_port", 70000),
    "block-ids-not-a-list": _set("remote_block_ids", "1,2,3"),
    "negative-block-id": _set("remote_block_ids", [[-1, 2]]),
    "absurd-block-id": _set("remote_block_ids", [[10**15]]),
    "block-id-beyond-p": _set("remote_block_ids", [[1_000_000, 1_000_001]]),
    "too-many-block-ids": _set("remote_block_ids", [list(range(200_000))]),
    "bool-as-block-id": _set("remote_block_ids", [[True, False]]),
    "flag-not-a-bool": _set("do_remote_prefill", "yes"),
    "missing-keys": lambda good: {"do_remote_prefill": True},
    "unknown-keys-only": lambda good: {"surprise": {"nested": [1, 2, 3]}},
    "engine-id-not-a-str": _set("remote_engine_id", {"$": 1}),
    "peer-that-does-not-exist": lambda good: {**good, "remote_host": "127.0.0.9", "remote_engine_id": "ghost"},
    "closed-port": _set("remote_port", 1),
    "huge-string": _set("remote_request_id", "x" * 2_000_000),
}


@pytest.fixture(scope="module")
def pair(host: EngineHost, models: dict[str, Path]) -> tuple[Engine, Engine]:
    p_config = pull_connector_config(CONNECTOR, "kv_producer", engine_id="hostile-p", kv_port=free_port_base(1))
    d_config = pull_connector_config(
        CONNECTOR, "kv_consumer", engine_id="hostile-d", kv_port=free_port_base(1), extra=FAST_FAILURE
    )
    p = host.spawn(EngineSpec(model=str(models["a"]), kv_transfer_config=p_config), "hostile-P")
    d = host.spawn(EngineSpec(model=str(models["a"]), kv_transfer_config=d_config), "hostile-D")
    yield p, d
    p.close()
    d.close()


def _prefill(p: Engine, prompts: list[list[int]]) -> list[Params]:
    done = p.generate(
        [Prompt(token_ids=x, max_tokens=1, kv_transfer_params={"do_remote_decode": True}) for x in prompts]
    )
    params = [c.kv_transfer_params for c in done]
    assert all(isinstance(x, dict) for x in params)
    return params  # type: ignore[return-value]


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_request_between_good_ones_on_decode(kind: str, pair: tuple[Engine, Engine], reference: Engine) -> None:
    p, d = pair
    prompts = make_prompts(1000 + sorted(HOSTILE).index(kind), (70, 150, 96))
    good = _prefill(p, prompts)
    sent = [good[0], HOSTILE[kind](good[1]), good[2]]
    got = d.generate(
        [Prompt(token_ids=x, max_tokens=8, kv_transfer_params=k) for x, k in zip(prompts, sent, strict=True)]
    )
    assert d.alive, f"{kind}: the decode engine died"
    assert_same_output(got, reference.generate(local(prompts)))
    # The engine keeps serving transfers.
    after = make_prompts(2000 + sorted(HOSTILE).index(kind), (64,))
    out = disaggregated_generate(p, d, after)
    assert_same_output([r.decode for r in out], reference.generate(local(after)))


def test_rejection_is_logged_once_naming_the_key(pair: tuple[Engine, Engine]) -> None:
    p, d = pair
    prompts = make_prompts(3000, (70,))
    good = _prefill(p, prompts)
    before = d.log_path.read_text(errors="replace").count("kv_transfer_params.remote_port")
    d.generate([Prompt(token_ids=prompts[0], max_tokens=2, kv_transfer_params={**good[0], "remote_port": "zzz"})])
    log = d.log_path.read_text(errors="replace")
    lines = [line for line in log.splitlines() if "kv_transfer_params.remote_port" in line]
    assert len(lines) - before == 1, lines[-3:]
    assert "zzz" in lines[-1]


def test_replayed_params_are_recomputed(pair: tuple[Engine, Engine], reference: Engine) -> None:
    """Params of a request D already consumed: P has freed those blocks, so D must not read them."""
    p, d = pair
    prompts = make_prompts(3100, (100,))
    good = _prefill(p, prompts)
    first = d.generate([Prompt(token_ids=prompts[0], max_tokens=4, kv_transfer_params=good[0])])
    other = make_prompts(3101, (100,))  # a different prompt carrying the consumed params
    second = d.generate([Prompt(token_ids=other[0], max_tokens=4, kv_transfer_params=good[0])])
    assert_same_output(first, reference.generate(local(prompts, 4)))
    assert_same_output(second, reference.generate(local(other, 4)))


@pytest.mark.parametrize(
    "params",
    [
        {"do_remote_decode": "yes"},
        {"do_remote_decode": True, "remote_block_ids": "x", "surprise": [None]},
        {"do_remote_decode": True, "do_remote_prefill": True},
        {"nothing-we-know": 1},
    ],
    ids=["flag-not-a-bool", "garbage-beside-the-flag", "both-flags", "unknown-key"],
)
def test_hostile_request_between_good_ones_on_prefill(
    params: Params, pair: tuple[Engine, Engine], reference: Engine
) -> None:
    p, _ = pair
    prompts = make_prompts(4000 + len(str(params)), (70, 90, 110))
    flags: list[Any] = [{"do_remote_decode": True}, params, {"do_remote_decode": True}]
    got = p.generate(
        [Prompt(token_ids=x, max_tokens=1, kv_transfer_params=f) for x, f in zip(prompts, flags, strict=True)]
    )
    assert p.alive
    assert_same_output(got, reference.generate(local(prompts, 1)))
    assert isinstance(got[0].kv_transfer_params, dict) and isinstance(got[2].kv_transfer_params, dict)
