"""Which P tp ranks a D rank reads for a request, over every group kind, and P's count of readers.

Runs in: scheduler and worker processes, on both roles (P counts the DONEs it waits for with the
same functions D plans with). No I/O, no threads, no torch.

Attention groups read the head sources of `ascend_dist.kv_mooncake.core.ranks.select_sources`;
state groups read ``P_tp / D_tp`` whole shards (`state_source_ranks`); a hybrid model reads the
union (`pull_source_ranks`).
"""

from __future__ import annotations

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.ranks import select_sources

__all__ = ["pull_source_ranks", "source_fan_in", "state_source_ranks", "tp_num_need_pulls"]


def state_source_ranks(d_rank: int, p_tp: int, d_tp: int) -> list[int]:
    """P tp ranks whose state shards D rank ``d_rank`` assembles (``d*k + j``, ``k = P_tp / D_tp``).

    Raises:
        ConfigError: ``P_tp`` is not a multiple of ``D_tp`` (a state shard cannot be split further).
    """
    if p_tp < d_tp or p_tp % d_tp:
        raise ConfigError("prefill.tp_size", p_tp, f"a multiple of decode.tp_size={d_tp} with state (Mamba) groups")
    k = p_tp // d_tp
    return [d_rank * k + j for j in range(k)]


def pull_source_ranks(
    d_rank: int,
    p_tp: int,
    d_tp: int,
    heads: int,
    remote_request_id: str,
    *,
    attention: bool = True,
    state: bool = False,
) -> list[int]:
    """Every P tp rank (within one PP stage) D rank ``d_rank`` reads for a request, sorted.

    The union of the attention groups' head sources (`select_sources`) and, for a hybrid model,
    the state groups' sources (`state_source_ranks`). P evaluates the same function to count DONEs.
    """
    ranks: set[int] = set()
    if attention:
        ranks.update(s.p_rank for s in select_sources(d_rank, p_tp, d_tp, heads, remote_request_id))
    if state:
        ranks.update(state_source_ranks(d_rank, p_tp, d_tp))
    return sorted(ranks)


def source_fan_in(
    p_rank: int,
    p_tp: int,
    d_tp: int,
    heads: int,
    remote_request_id: str,
    *,
    attention: bool = True,
    state: bool = False,
) -> int:
    """How many D ranks read P tp rank ``p_rank`` for this request (each sends one DONE per PP stage rank)."""
    return sum(
        p_rank in pull_source_ranks(d, p_tp, d_tp, heads, remote_request_id, attention=attention, state=state)
        for d in range(d_tp)
    )


def tp_num_need_pulls(heads: int, p_tp: int, d_tp: int, *, use_mla: bool = False) -> int:
    """P ranks one D rank reads per PP stage for an attention group.

    ``max(1, H // D_tp) // max(1, H // P_tp)``; 1 for MLA. `select_sources` yields exactly this
    many P ranks for ``P_tp >= D_tp`` (one P rank for ``P_tp < D_tp``, which upstream refuses).

    Example: H=8, P8, D2 -> 4; H=4, P8, D2 -> 2; H=4, P16, D8 -> 1; H=32, P8, D4 -> 2.
    """
    if use_mla:
        return 1
    return max(1, max(1, heads // d_tp) // max(1, heads // p_tp))
