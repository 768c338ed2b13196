"""P/D pulls between engines of different TP sizes (TP 2 on one side, float32), with their controls.

``P_tp > D_tp``: D stacks the heads of two P ranks into each block. ``P_tp < D_tp``: each D rank
reads its half of P's heads (a case upstream refuses). On a 2-core machine a TP-2 engine binds one
core per worker (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Float32 keeps TP 1 and TP 2 greedy tokens
identical, so every D output is compared with the TP-1 reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.pd import disaggregated_generate, pull_connector_config
from ascend_dist.cli.engines.wire import EngineSpec
from ascend_dist.testing.engines import (
    TP2_ENV,
    assert_every_output_differs,
    assert_same_output,
    free_port_base,
    local,
    make_prompts,
)

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CONNECTOR = "MooncakeConnectorV1"


def spawn(host: EngineHost, model: Path, tp: int, config: dict, name: str) -> Engine:
    spec = EngineSpec(
        model=str(model), tensor_parallel_size=tp, kv_transfer_config=config, env=TP2_ENV if tp > 1 else {}
    )
    return host.spawn(spec, name, timeout_s=400)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_pull_across_tp_sizes(
    p_tp: int, d_tp: int, host: EngineHost, models: dict[str, Path], reference: Engine
) -> None:
    def side(role: str, engine_id: str, tp: int) -> dict:
        return pull_connector_config(
            CONNECTOR, role, engine_id=engine_id, kv_port=free_port_base(2), prefill_tp=p_tp, decode_tp=d_tp
        )

    d = spawn(host, models["a"], d_tp, side("kv_consumer", f"tp-d{p_tp}{d_tp}", d_tp), f"D-tp{d_tp}")
    p = spawn(host, models["a"], p_tp, side("kv_producer", f"tp-p{p_tp}{d_tp}", p_tp), f"P-tp{p_tp}")
    try:
        prompts = make_prompts(5000 + 10 * p_tp + d_tp)
        out = disaggregated_generate(p, d, prompts)
        assert_same_output([r.decode for r in out], reference.generate(local(prompts)))
    finally:
        p.close()
    # The control: the same D fed by a P of the same TP size on other weights.
    other = spawn(host, models["b"], p_tp, side("kv_producer", f"tp-q{p_tp}{d_tp}", p_tp), f"P-tp{p_tp}-other")
    try:
        prompts = make_prompts(6000 + 10 * p_tp + d_tp)
        out = disaggregated_generate(other, d, prompts)
        assert_every_output_differs([r.decode for r in out], reference.generate(local(prompts)))
    finally:
        other.close()
        d.close()
