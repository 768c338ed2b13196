"""A disaggregated-prefill proxy over two `Engine`s, as a router in front of vLLM would run it.

Runs in: the caller's process. Each prompt goes to P with ``max_tokens=1`` and
``{"do_remote_decode": true}``; the ``kv_transfer_params`` P returns go to D with the prompt, and D
continues from P's KV cache instead of recomputing it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ascend_dist.cli.engines.host import Engine, EngineError
from ascend_dist.cli.engines.wire import Completion, Prompt

__all__ = ["Disaggregated", "disaggregated_generate", "pull_connector_config"]


@dataclass(frozen=True)
class Disaggregated:
    """One prompt through the pair: what P returned, what D generated, and D's batch time."""

    prefill: Completion
    decode: Completion
    decode_seconds: float


def disaggregated_generate(
    prefill: Engine, decode: Engine, prompts: Sequence[Sequence[int]], *, max_tokens: int = 8, timeout_s: float = 120.0
) -> list[Disaggregated]:
    """Run ``prompts`` through P then D, each side in one batch.

    Raises:
        EngineError: P returned no ``kv_transfer_params`` for a prompt, or an engine failed.
    """
    first = prefill.generate(
        [Prompt(token_ids=list(p), max_tokens=1, kv_transfer_params={"do_remote_decode": True}) for p in prompts],
        timeout_s,
    )
    for i, c in enumerate(first):
        if c.kv_transfer_params is None:
            raise EngineError(f"{prefill.name} returned no kv_transfer_params for prompt {i} ({c.error or 'no error'})")
    second = decode.generate_timed(
        [
            Prompt(token_ids=list(p), max_tokens=max_tokens, kv_transfer_params=c.kv_transfer_params)
            for p, c in zip(prompts, first, strict=True)
        ],
        timeout_s,
    )
    return [Disaggregated(p, d, second.seconds) for p, d in zip(first, second.completions, strict=True)]


def pull_connector_config(
    connector: str,
    role: str,
    *,
    engine_id: str,
    kv_port: int,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``kv_transfer_config`` of one side of a kv-mooncake pair, on 127.0.0.1 over TCP.

    D recomputes what it could not load (``kv_load_failure_policy="recompute"``; vLLM 0.32 fails the
    request by default).
    """
    return {
        "kv_connector": connector,
        "kv_role": role,
        "engine_id": engine_id,
        "kv_port": kv_port,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "prefill": {"tp_size": prefill_tp},
            "decode": {"tp_size": decode_tp},
            "host": "127.0.0.1",
            "mooncake_protocol": "tcp",
            **(extra or {}),
        },
    }
