"""Signed pull capabilities between two real vLLM engines sharing a deployment secret (issue 23).

A client of D who knows one live P request (its own) widens ``remote_block_ids`` to another live
request's blocks (same length): D refuses the params before reading and recomputes the client's own
prompt (its output equals the reference). The control: what that widened read would have decoded
(the victim's KV for all but the last token, the attacker's last token, as observed on the
unsigned main) differs from the reference, so an equal output proves D did not read the victim's
KV. Both requests' untouched params are still served from P afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.pd import pull_connector_config
from ascend_dist.cli.engines.wire import EngineSpec, Prompt
from ascend_dist.common.secret import SECRET_ENV
from ascend_dist.testing.engines import assert_same_output, free_port_base, local, make_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CONNECTOR = "MooncakeConnectorV1"
FAST_FAILURE = {"rpc_timeout_s": 1.0, "rpc_retries": 2, "pull_timeout_s": 20.0}
SECRET = {SECRET_ENV: "9d" * 32}


@pytest.fixture(scope="module")
def signed(host: EngineHost, models: dict[str, Path]) -> Any:
    p_config = pull_connector_config(CONNECTOR, "kv_producer", engine_id="signed-p", kv_port=free_port_base(1))
    d_config = pull_connector_config(
        CONNECTOR, "kv_consumer", engine_id="signed-d", kv_port=free_port_base(1), extra=FAST_FAILURE
    )
    p = host.spawn(EngineSpec(model=str(models["a"]), kv_transfer_config=p_config, env=SECRET), "signed-P")
    d = host.spawn(EngineSpec(model=str(models["a"]), kv_transfer_config=d_config, env=SECRET), "signed-D")
    yield p, d
    p.close()
    d.close()


def test_widened_block_ids_get_the_clients_own_prompt_recomputed(signed: Any, reference: Engine) -> None:
    p, d = signed
    victim, mine = make_prompts(5100, (100, 100))
    lent = p.generate(
        [Prompt(token_ids=x, max_tokens=1, kv_transfer_params={"do_remote_decode": True}) for x in (victim, mine)]
    )
    params_v, params_m = (c.kv_transfer_params for c in lent)
    assert isinstance(params_v, dict) and isinstance(params_m, dict)
    assert len(params_v["remote_capability"]) == 64  # P signed what it handed out
    ids_v, ids_m = params_v["remote_block_ids"], params_m["remote_block_ids"]
    assert [len(g) for g in ids_v] == [len(g) for g in ids_m] and ids_v != ids_m

    # Control: the widened read would decode the victim's KV with the attacker's last token.
    would_read = reference.generate(local([victim[:-1] + mine[-1:]]))
    want = reference.generate(local([mine]))
    assert would_read[0].token_ids != want[0].token_ids, "control: the widened read would not change the output"

    forged = {**params_m, "remote_block_ids": ids_v}
    got = d.generate([Prompt(token_ids=mine, max_tokens=8, kv_transfer_params=forged)], timeout_s=120)
    assert_same_output(got, want)  # recomputed: never the victim's KV
    assert "kv_transfer_params.remote_capability" in d.log_path.read_text(errors="replace")

    # Both untouched params are still served from P (the refusal read nothing and freed nothing).
    again = d.generate(
        [Prompt(token_ids=x, max_tokens=8, kv_transfer_params=c) for x, c in ((victim, params_v), (mine, params_m))]
    )
    assert_same_output(again, reference.generate(local([victim, mine])))
    assert p.alive and d.alive
