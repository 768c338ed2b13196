"""`MooncakeHybridConnector` between two real engines on a hybrid model (Gated DeltaNet + attention).

The model (a tiny Qwen3-Next: three linear-attention layers with conv and recurrent state, then one
full-attention layer) runs in bfloat16, as vLLM's CPU build requires for its GDN state; P and D have
the same TP size. Prefix caching is off (hybrid state caching is a separate mode).

* Identity: every generated token of D equals the no-connector reference's up to a near-tie the two
  kernel orders may break apart; the first token's logprob within ``ATOL`` (D computes it from the
  transferred KV and state and one step), each later one within ``LATER_ATOL`` and all of them
  within ``MEAN_ATOL`` on average (see `_assert_same_where_kernels_agree`).
* One control per state kind, each of which must move D's first token beyond ``ATOL`` on every
  prompt (more than the two kernel orders ever differ by, so no control passes by noise):
  - attention KV alone: P serves a model whose weights differ from D's only in the full-attention
    layer's attention. The three recurrent layers come before it, so P's conv and recurrent states
    are bit for bit the reference's; only the attention KV D loads is different.
  - recurrent state alone: D runs `ascend_dist.testing.state_poison`, the real connector that zeroes
    each request's state blocks after its load (what a connector that never moved the state would
    leave) and touches no attention block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.pd import disaggregated_generate, pull_connector_config
from ascend_dist.cli.engines.wire import Completion, EngineSpec
from ascend_dist.testing.engines import free_port_base, local, make_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

CONNECTOR = "MooncakeHybridConnector"
STATE_POISON = ("ascend_dist.testing.state_poison", "StatePoisoningHybridConnector")
ATTENTION = "model.layers.3.self_attn."  # the full-attention layer (TINY_QWEN3_NEXT's layer_types)
LENGTHS = (70, 200, 333)
TOKENS = 8
# bfloat16: D runs the last prompt token through the recurrent kernel, the reference through the
# chunked one, and the difference compounds over D's own decode steps. Measured: first tokens at
# most 0.046 apart on two machines; later tokens at most 0.046 on one (24 tokens) and once
# 0.221 on an AMD EPYC with avx512_bf16 (the same token; the next ones 0.03 again), mean 0.03; each
# control changed the first token or moved its logprob by 0.13-0.5.
ATOL = 0.1
LATER_ATOL = 0.3
MEAN_ATOL = 0.06


@pytest.fixture(scope="module")
def hybrid_models(host: EngineHost, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {
        "a": host.write_model(root / "a" / "tiny-hybrid", seed=11, architecture="qwen3_next"),
        # The same weights but the full-attention layer's attention: the same name, so D accepts P.
        "attention": host.write_model(
            root / "attention" / "tiny-hybrid", seed=11, architecture="qwen3_next", redraw=ATTENTION, redraw_seed=12
        ),
    }


def spec(model: Path, config: dict[str, Any] | None = None) -> EngineSpec:
    return EngineSpec(
        model=str(model), dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False, kv_transfer_config=config
    )


def d_config(engine_id: str, connector: str = CONNECTOR) -> dict[str, Any]:
    return pull_connector_config(
        connector, "kv_consumer", engine_id=engine_id, kv_port=free_port_base(1), extra={"pull_timeout_s": 20.0}
    )


@pytest.fixture(scope="module")
def engines(host: EngineHost, hybrid_models: dict[str, Path]) -> Iterator[tuple[Engine, Engine, Engine]]:
    reference = host.spawn(spec(hybrid_models["a"]), "hybrid-reference")
    p_config = pull_connector_config(CONNECTOR, "kv_producer", engine_id="hyb-p", kv_port=free_port_base(1))
    p = host.spawn(spec(hybrid_models["a"], p_config), "hybrid-P")
    d = host.spawn(spec(hybrid_models["a"], d_config("hyb-d")), "hybrid-D")
    yield reference, p, d
    for e in (reference, p, d):
        e.close()


def _full(got: Sequence[Completion], want: Sequence[Completion]) -> None:
    """Both sides answered every prompt in full: an empty or short output proves nothing."""
    assert len(got) == len(want) > 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert w.error is None and len(w.token_ids) == TOKENS, f"prompt {i}: reference {w.error or w.token_ids}"
        assert g.error is None and len(g.token_ids) == TOKENS, f"prompt {i}: D {g.error or g.token_ids}"
        assert len(g.logprobs) == len(w.logprobs) == TOKENS


def _assert_same_where_kernels_agree(got: Sequence[Completion], want: Sequence[Completion]) -> str:
    """Every token equal with logprobs within ``ATOL``, up to a near-tie the two kernel orders may break apart.

    With the same history, D's and the reference's distributions differ by kernel noise only, so
    where their greedy picks part, each side's pick must be about as likely as the other's (logprobs
    within ``ATOL``): two tokens tied within the noise. From there on they continue different texts
    and the comparison stops. The first token must always agree (D computes it from the transferred
    KV and state alone), and at least half of all tokens must have been compared.
    """
    _full(got, want)
    compared, worst, parted, total = 0, 0.0, [], 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (gt, wt) in enumerate(zip(g.token_ids, w.token_ids, strict=True)):
            gl, wl = g.logprobs[j], w.logprobs[j]
            atol = ATOL if j == 0 else LATER_ATOL
            if gt != wt:
                assert j > 0, f"prompt {i}: first token {gt} != reference {wt} (logprobs {gl:.4f}, {wl:.4f})"
                assert abs(gl - wl) <= atol, (
                    f"prompt {i}: token {j} is {gt} (logprob {gl:.4f}), the reference's {wt} ({wl:.4f}): "
                    "they part where the two picks are not tied within the kernels' noise"
                )
                parted.append(f"prompt {i} at token {j}")
                break
            assert abs(gl - wl) <= atol, f"prompt {i} token {j}: logprob {gl:.4f} vs reference {wl:.4f}"
            compared += 1
            worst = max(worst, abs(gl - wl))
            total += abs(gl - wl)
    assert compared * 2 >= TOKENS * len(want), f"only {compared} tokens compared: the check proves little"
    mean = total / compared
    assert mean <= MEAN_ATOL, f"mean |dlogprob| {mean:.4f} over {compared} tokens: more than the kernels' noise"
    return (
        f"{compared}/{TOKENS * len(want)} tokens equal (worst |dlogprob| {worst:.4f}, mean {mean:.4f}); "
        f"parted: {parted or 'none'}"
    )


def _assert_first_token_moved(got: Sequence[Completion], want: Sequence[Completion]) -> str:
    """The control: on every prompt D's first token or its logprob moved by more than ``ATOL``."""
    _full(got, want)
    moves = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        moved = g.token_ids[0] != w.token_ids[0] or abs(g.logprobs[0] - w.logprobs[0]) > ATOL
        assert moved, (
            f"prompt {i}: D's first token {g.token_ids[0]} ({g.logprobs[0]:.4f}) is the reference's "
            f"({w.logprobs[0]:.4f}): D did not use the poisoned part"
        )
        moves.append(f"{w.token_ids[0]}->{g.token_ids[0]} ({w.logprobs[0]:.3f}->{g.logprobs[0]:.3f})")
    return "first tokens: " + ", ".join(moves)


def test_decode_continues_from_prefill_on_a_hybrid_model(engines: tuple[Engine, Engine, Engine]) -> None:
    reference, p, d = engines
    prompts = make_prompts(8001, LENGTHS)
    got = [r.decode for r in disaggregated_generate(p, d, prompts, max_tokens=TOKENS)]
    print(_assert_same_where_kernels_agree(got, reference.generate(local(prompts, TOKENS))))


def test_control_attention_kv_alone_changes_every_output(
    host: EngineHost, hybrid_models: dict[str, Path], engines: tuple[Engine, Engine, Engine]
) -> None:
    """P on weights that differ only in the attention layer: same states, other attention KV."""
    reference, _, d = engines
    config = pull_connector_config(CONNECTOR, "kv_producer", engine_id="hyb-p-attn", kv_port=free_port_base(1))
    other = host.spawn(spec(hybrid_models["attention"], config), "hybrid-P-other-attention")
    try:
        prompts = make_prompts(8002, LENGTHS)
        out = disaggregated_generate(other, d, prompts, max_tokens=TOKENS)
        print(_assert_first_token_moved([r.decode for r in out], reference.generate(local(prompts, TOKENS))))
    finally:
        other.close()


def test_control_recurrent_state_alone_changes_every_output(
    host: EngineHost, hybrid_models: dict[str, Path], engines: tuple[Engine, Engine, Engine]
) -> None:
    """D zeroes the loaded conv and recurrent state (and nothing else) before its first forward."""
    reference, p, _ = engines
    config = d_config("hyb-d-state", STATE_POISON[1])
    config["kv_connector_module_path"] = STATE_POISON[0]
    poisoned = host.spawn(spec(hybrid_models["a"], config), "hybrid-D-state-zeroed")
    try:
        prompts = make_prompts(8003, LENGTHS)
        out = disaggregated_generate(p, poisoned, prompts, max_tokens=TOKENS)
        print(_assert_first_token_moved([r.decode for r in out], reference.generate(local(prompts, TOKENS))))
    finally:
        poisoned.close()
