"""Parallel-layout math shared by the KV connectors: head ownership, CP head groups, side-channel ports.

Runs in: scheduler and worker processes. Pure: stdlib only, no I/O, no torch.

Vocabulary (vLLM's layout, which every function here assumes):

* A TP group of ``tp`` ranks holds the KV heads. With ``tp <= H`` each rank holds ``H / tp``
  consecutive heads; with ``tp > H`` each head is replicated on ``tp / H`` consecutive ranks.
* Decode context parallelism (DCP) splits *tokens* across ``dcp`` consecutive TP ranks holding the
  same heads: ``dcp_rank = tp_rank % dcp`` and the **head-group rank** is ``tp_rank // dcp``.
* Prefill context parallelism (PCP) adds ``pcp`` whole TP groups, each with a share of the tokens.
  A sequence's logical block ``l`` lives on CP index ``l mod (pcp * dcp)``, where the CP index of a
  rank is ``pcp_rank * dcp + dcp_rank`` (round-robin interleaving).

`get_cp_group` partitions head-group ranks into *CP groups*: sets of head groups that together hold
one full copy of all heads. The layer-wise push pairs a P CP group with a D CP group per request
(`select_group_pair`); `ascend_dist.kv_mooncake.core.transfer_mappings` then plans the blocks.

The side-channel port helpers (`PortLayout`, defined in `ascend_dist.kv_mooncake.core.ports` and re-exported
here) implement the deterministic port-offset scheme that lets a peer compute a worker's ZMQ port
without discovery.

Upstream reference: vllm-ascend ``distributed/kv_transfer/utils/utils.py`` and the Mooncake
connectors' ``handshake_port`` computation (v0.11).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.ports import MAX_PORT, PortLayout, PortScheme, RankCoord

__all__ = [
    "MAX_PORT",
    "GroupPair",
    "ParallelInfo",
    "PortLayout",
    "PortScheme",
    "RankCoord",
    "context_parallel_parameters_check",
    "get_cp_group",
    "get_head_group_mapping",
    "get_tp_rank_head_mapping",
    "pd_head_ratio",
    "round_robin_count",
    "select_group_pair",
    "select_group_window",
]


def _require_positive(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "an integer >= 1")
    return value


@dataclass(frozen=True)
class ParallelInfo:
    """The parallel layout of one side (P or D) of a transfer.

    Attributes:
        tp_size: Tensor-parallel size.
        pcp_size: Prefill context-parallel size.
        dcp_size: Decode context-parallel size; divides ``tp_size``.
        use_mla: MLA/sparse model: one latent KV "head", replicated on every TP rank.
        pd_head_ratio: How many P ranks feed one D rank's heads (``P_tp / D_tp`` for GQA with
            ``P_tp > D_tp``, else 1); multiplies the number of completion signals D waits for.
    """

    tp_size: int
    pcp_size: int = 1
    dcp_size: int = 1
    use_mla: bool = False
    pd_head_ratio: int = 1

    def __post_init__(self) -> None:
        """Validate sizes.

        Raises:
            ConfigError: A size is not an integer >= 1, or ``dcp_size`` does not divide ``tp_size``.
        """
        for name in ("tp_size", "pcp_size", "dcp_size", "pd_head_ratio"):
            _require_positive(name, getattr(self, name))
        if self.tp_size % self.dcp_size:
            raise ConfigError("dcp_size", self.dcp_size, f"a divisor of tp_size={self.tp_size}")
        if not isinstance(self.use_mla, bool):
            raise ConfigError("use_mla", self.use_mla, "a bool")

    @property
    def cp_size(self) -> int:
        """Total context-parallel size ``pcp * dcp`` (the block interleaving period)."""
        return self.pcp_size * self.dcp_size

    @property
    def num_head_groups(self) -> int:
        """Number of head-group ranks, ``tp / dcp``."""
        return self.tp_size // self.dcp_size

    @property
    def world_size(self) -> int:
        """Ranks of one instance (excluding PP and DP): ``pcp * tp``."""
        return self.pcp_size * self.tp_size

    def dcp_rank(self, tp_rank: int) -> int:
        """The DCP rank of a TP rank (``tp_rank % dcp``)."""
        return tp_rank % self.dcp_size

    def head_group_rank(self, tp_rank: int) -> int:
        """The head-group rank of a TP rank (``tp_rank // dcp``)."""
        return tp_rank // self.dcp_size

    def cp_index(self, pcp_rank: int, dcp_rank: int) -> int:
        """The rank's position in the block interleaving: ``pcp_rank * dcp + dcp_rank``."""
        return pcp_rank * self.dcp_size + dcp_rank


def round_robin_count(num_items: int, size: int, index: int) -> int:
    """How many of items ``0 .. num_items-1`` fall on ``index`` when dealt round-robin over ``size``.

    Args:
        num_items: Items dealt (``>= 0``), e.g. prompt blocks.
        size: Number of receivers (``>= 1``), e.g. a CP size.
        index: The receiver, ``0 <= index < size``.

    Returns:
        ``num_items // size + (index < num_items % size)``.

    Raises:
        ConfigError: An argument is out of range.
    """
    _require_positive("size", size)
    if num_items < 0:
        raise ConfigError("num_items", num_items, "an integer >= 0")
    if not 0 <= index < size:
        raise ConfigError("index", index, f"an integer in [0, {size})")
    return num_items // size + int(index < num_items % size)


def get_tp_rank_head_mapping(num_heads: int, tp_size: int) -> dict[int, list[int]]:
    """Which KV heads each TP rank holds.

    Args:
        num_heads: Total KV heads ``H`` (1 for MLA).
        tp_size: TP size.

    Returns:
        ``{tp_rank: [head, ...]}``. ``tp <= H``: rank ``r`` holds heads ``r*H/tp .. (r+1)*H/tp - 1``;
        ``tp > H``: rank ``r`` holds head ``r // (tp / H)``.

    Raises:
        ConfigError: A size is < 1, or the larger of ``H`` and ``tp`` is not a multiple of the other.
    """
    _require_positive("num_heads", num_heads)
    _require_positive("tp_size", tp_size)
    if tp_size <= num_heads:
        if num_heads % tp_size:
            raise ConfigError("num_heads", num_heads, f"a multiple of tp_size={tp_size}")
        per_rank = num_heads // tp_size
        return {r: list(range(r * per_rank, (r + 1) * per_rank)) for r in range(tp_size)}
    if tp_size % num_heads:
        raise ConfigError("tp_size", tp_size, f"a multiple of num_heads={num_heads}")
    ranks_per_head = tp_size // num_heads
    return {r: [r // ranks_per_head] for r in range(tp_size)}


def pd_head_ratio(p_tp: int, d_tp: int, num_heads: int, *, use_mla: bool = False) -> int:
    """How many P head groups feed one D rank's heads: ``min(P_tp, H) // min(D_tp, H)``.

    Replicated heads do not count (``P_tp = 8``, ``H = 4``, ``D_tp = 2`` -> 2), and MLA is always 1.
    It is the factor by which D's expected completion count grows and the size of P's all-to-all
    resharding group (vllm-ascend ``AscendConfig``, v0.11).

    Args:
        p_tp: P's TP size.
        d_tp: D's TP size; must divide ``p_tp`` (P_tp < D_tp is not supported).
        num_heads: Total KV heads.
        use_mla: MLA/sparse model.

    Returns:
        The ratio, ``>= 1``.

    Raises:
        ConfigError: A size is < 1 or ``d_tp`` does not divide ``p_tp``.
    """
    _require_positive("p_tp", p_tp)
    _require_positive("d_tp", d_tp)
    _require_positive("num_heads", num_heads)
    if p_tp % d_tp:
        raise ConfigError("d_tp", d_tp, f"a divisor of P's tp_size={p_tp}")
    if use_mla:
        return 1
    return min(p_tp, num_heads) // min(d_tp, num_heads)


def get_head_group_mapping(
    num_heads: int, tp_size: int, num_groups: int, selected: Collection[int] | None = None
) -> dict[int, list[int]]:
    """Which KV heads each head group holds (the union over its consecutive TP ranks).

    Args:
        num_heads: Total KV heads.
        tp_size: TP size.
        num_groups: Number of head groups (``tp / dcp``); divides ``tp_size``.
        selected: Head-group ranks to include; all when None.

    Returns:
        ``{head_group_rank: sorted heads}`` for the selected groups, in ascending group order.

    Raises:
        ConfigError: ``num_groups`` does not divide ``tp_size``, or as `get_tp_rank_head_mapping`.
    """
    _require_positive("num_groups", num_groups)
    if tp_size % num_groups:
        raise ConfigError("num_groups", num_groups, f"a divisor of tp_size={tp_size}")
    per_group = tp_size // num_groups
    rank_heads = get_tp_rank_head_mapping(num_heads, tp_size)
    mapping: dict[int, list[int]] = {}
    for group in range(num_groups):
        if selected is not None and group not in selected:
            continue
        heads = {h for r in range(group * per_group, (group + 1) * per_group) for h in rank_heads[r]}
        mapping[group] = sorted(heads)
    return mapping


def get_cp_group(tp: int, heads: int, dcp: int) -> list[list[int]]:
    """Partition head-group ranks into CP groups that each hold one full copy of all heads.

    With ``step = tp // heads`` replicas per head: ``step == 0`` (fewer ranks than heads) gives one
    group ``[0 .. tp - 1]`` (DCP must then be 1); otherwise there are ``step / dcp`` groups and
    group ``i`` holds, for every head ``h``, the head-group ranks ``k // dcp`` of TP ranks
    ``k in [h*step + i*dcp, h*step + (i+1)*dcp)``.

    Examples:
        >>> get_cp_group(8, 4, 2)
        [[0, 1, 2, 3]]
        >>> get_cp_group(8, 4, 1)
        [[0, 2, 4, 6], [1, 3, 5, 7]]

    Args:
        tp: TP size.
        heads: Total KV heads (1 for MLA).
        dcp: DCP size.

    Returns:
        Groups of head-group ranks, each sorted; groups are disjoint.

    Raises:
        ConfigError: A size is < 1, ``dcp`` does not divide ``tp``, the larger of ``tp`` and
            ``heads`` is not a multiple of the other, or ``dcp`` does not divide ``tp // heads``
            (DCP ranks must share their heads, so DCP needs replicated heads; upstream returns an
            empty or mixed-head partition instead).
    """
    for name, value in (("tp", tp), ("heads", heads), ("dcp", dcp)):
        _require_positive(name, value)
    if tp % dcp:
        raise ConfigError("dcp", dcp, f"a divisor of tp={tp}")
    step = tp // heads
    if step == 0:
        if heads % tp:
            raise ConfigError("heads", heads, f"a multiple of tp={tp}")
        if dcp != 1:  # no head is replicated, so DCP ranks could not share their heads
            raise ConfigError("dcp", dcp, f"1 when tp={tp} < heads={heads}")
        return [list(range(tp))]
    if tp % heads:
        raise ConfigError("tp", tp, f"a multiple of heads={heads}")
    if step % dcp:
        raise ConfigError("dcp", dcp, f"a divisor of tp // heads = {step}")
    return [
        sorted({k // dcp for h in range(heads) for k in range(h * step + i * dcp, h * step + (i + 1) * dcp)})
        for i in range(step // dcp)
    ]


@dataclass(frozen=True)
class GroupPair:
    """The P CP group and D CP group paired for one request (both as head-group ranks)."""

    p_group: tuple[int, ...]
    d_group: tuple[int, ...]
    index: int


def select_group_window(
    p_groups: Sequence[Sequence[int]], d_groups: Sequence[Sequence[int]], req_idx: int
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Choose which P CP groups serve a request, aligned with D's groups position by position.

    ``cp_ratio = len(P) // len(D)``: 0 -> all groups on both sides; else the window of ``len(D)``
    P groups starting at ``(req_idx mod cp_ratio) * len(D)``, which spreads requests over P's
    replicas by their index in the step.

    Args:
        p_groups: P's CP groups (`get_cp_group`).
        d_groups: D's CP groups.
        req_idx: The request's index in this step's metadata (same on all P ranks).

    Returns:
        ``(selected P groups, D groups)`` of equal length.

    Raises:
        ConfigError: A side has no groups, ``req_idx < 0``, or P has fewer groups than D but not
            the same number.
    """
    if not p_groups or not d_groups:
        raise ConfigError("cp_groups", (len(p_groups), len(d_groups)), "at least one group per side")
    if req_idx < 0:
        raise ConfigError("req_idx", req_idx, "an integer >= 0")
    p_all = [tuple(g) for g in p_groups]
    d_all = [tuple(g) for g in d_groups]
    cp_ratio = len(p_all) // len(d_all)
    if cp_ratio == 0:
        if len(p_all) != len(d_all):
            raise ConfigError(
                "cp_groups", f"P has {len(p_all)}, D has {len(d_all)}", "P to have a multiple of D's count"
            )
        return p_all, d_all
    start = (req_idx % cp_ratio) * len(d_all)
    return p_all[start : start + len(d_all)], d_all


def select_group_pair(
    p_groups: Sequence[Sequence[int]],
    d_groups: Sequence[Sequence[int]],
    *,
    req_idx: int,
    head_group_rank: int,
) -> GroupPair | None:
    """Pair this P rank's CP group with a D CP group for one request.

    Args:
        p_groups: P's CP groups (`get_cp_group`).
        d_groups: D's CP groups.
        req_idx: The request's index in this step's metadata.
        head_group_rank: This P rank's head-group rank (``tp_rank // dcp``).

    Returns:
        The pair whose P group contains ``head_group_rank`` within the selected window, or None
        when this P rank sends nothing for the request.

    Raises:
        ConfigError: As `select_group_window`.
    """
    selected_p, selected_d = select_group_window(p_groups, d_groups, req_idx)
    for index, (p_group, d_group) in enumerate(zip(selected_p, selected_d, strict=True)):
        if head_group_rank in p_group:
            return GroupPair(p_group=p_group, d_group=d_group, index=index)
    return None


def context_parallel_parameters_check(p: ParallelInfo, d: ParallelInfo, num_heads: int) -> None:
    """Check that a P layout can push to a D layout (layer-wise connector).

    Rules (vllm-ascend ``context_parallel_parameters_check``, v0.11):

    1. ``(P.pcp * P.dcp) % (D.pcp * D.dcp) == 0``: each D CP rank is fed by whole P CP ranks.
    2. Non-MLA only: ``ceil(H / D.dcp_size) % ceil(H / P.tp_size) == 0``. Upstream compares with
       **D's dcp size**, not D's TP size (heads per D rank would be ``ceil(H / D.tp)``). The rule is
       kept as is so both implementations accept the same deployments; with ``D.dcp == 1`` it only
       requires that P's heads per rank divide ``H``.

    Args:
        p: P's (sender's) layout.
        d: D's (receiver's) layout.
        num_heads: Total KV heads.

    Raises:
        ConfigError: A rule is violated; the field names which one.
    """
    _require_positive("num_heads", num_heads)
    if p.cp_size % d.cp_size:
        raise ConfigError(
            "pcp_size*dcp_size",
            f"P={p.pcp_size}*{p.dcp_size}, D={d.pcp_size}*{d.dcp_size}",
            "P's CP size to be a multiple of D's",
        )
    if not p.use_mla:
        d_heads = math.ceil(num_heads / d.dcp_size)
        p_heads = math.ceil(num_heads / p.tp_size)
        if d_heads % p_heads:
            raise ConfigError(
                "num_heads",
                f"ceil(H/D.dcp_size)={d_heads}, ceil(H/P.tp_size)={p_heads} (H={num_heads})",
                "ceil(H/D.dcp_size) to be a multiple of ceil(H/P.tp_size)",
            )
