"""D-side placement for the layer-wise push: which D rank and block hold a logical block, and DONE counts.

Runs in: prefill worker processes (once per request per step). Pure: stdlib only. Used by
`ascend_dist.kv_mooncake.core.transfer_mappings`, which re-exports both functions.

Upstream reference: vllm-ascend ``distributed/kv_transfer/utils/utils.py`` (v0.11). Both functions
deliberately differ from upstream; each docstring says where and why.
"""

from __future__ import annotations

from collections.abc import Sequence

from ascend_dist.common.errors import BlockIdError, ConfigError
from ascend_dist.kv_mooncake.core.mappings import ParallelInfo
from ascend_dist.kv_mooncake.core.transfer_records import DBlockLocation, Endpoint

__all__ = ["completion_counts", "d_block_location"]


def d_block_location(
    logical: int, head_group: int, d: ParallelInfo, hosts: Sequence[str], base_port: int
) -> DBlockLocation:
    """Locate logical block ``logical`` of D head group ``head_group`` on D.

    ``pcp = (l // D.dcp) mod D.pcp``, ``dcp = l mod D.dcp``, world rank
    ``pcp * D.tp + head_group * D.dcp + dcp``, port ``base_port + world``, host
    ``hosts[len(hosts) * world // (D.pcp * D.tp)]`` (hosts split the world evenly, in order).

    Block index: the rank's CP index is ``c = pcp * D.dcp + dcp = l mod Lcp`` (``Lcp = D.pcp *
    D.dcp``), so the rank holds ``c, c + Lcp, c + 2 Lcp, ...`` and ``l`` is at ``(l - c) // Lcp =
    l // Lcp``. Upstream computes ``(l - (pcp * D.pcp + dcp)) // Lcp``, multiplying by ``pcp_size``
    instead of ``dcp_size``: identical when ``D.pcp <= 1`` (then ``pcp == 0``) or ``D.pcp == D.dcp``,
    wrong otherwise (``pcp=2, dcp=1, l=1`` gives -1, i.e. the *last* remote block). We use the
    correct form.

    Args:
        logical: Logical block index (``>= 0``).
        head_group: D head-group rank (``tp_rank // D.dcp``).
        d: D's layout.
        hosts: D hosts, splitting D's ``pcp * tp`` ranks evenly in order.
        base_port: D's advertised base port.

    Returns:
        The D rank's coordinates, endpoint and the block's position in its list.

    Raises:
        BlockIdError: ``logical`` is negative.
        ConfigError: ``hosts`` is empty or ``head_group`` is out of range.
    """
    if not hosts:
        raise ConfigError("d_hosts", list(hosts), "at least one D host")
    if logical < 0:
        raise BlockIdError("logical", logical, "a block index >= 0")
    if not 0 <= head_group < d.num_head_groups:
        raise ConfigError("head_group", head_group, f"an integer in [0, {d.num_head_groups})")
    pcp_rank = (logical // d.dcp_size) % d.pcp_size
    dcp_rank = logical % d.dcp_size
    world = pcp_rank * d.tp_size + head_group * d.dcp_size + dcp_rank
    host = hosts[len(hosts) * world // d.world_size]
    return DBlockLocation(
        pcp_rank=pcp_rank,
        dcp_rank=dcp_rank,
        world_rank=world,
        endpoint=Endpoint(host, base_port + world),
        block_idx=logical // d.cp_size,
    )


def completion_counts(
    p: ParallelInfo,
    d: ParallelInfo,
    hosts: Sequence[str],
    base_port: int,
    *,
    num_blocks: int,
    prefix_blocks: int,
) -> dict[Endpoint, int]:
    """How many completion signals (DONE) each D endpoint waits for.

    A D rank at CP index ``c`` receives from the P CP ranks ``q`` with ``q mod Lcp == c`` (P's CP
    size is a multiple of D's); such a rank sends only if it holds a block in
    ``[prefix_blocks, num_blocks)``. The count is those P CP ranks times ``pd_head_ratio``.

    Upstream (v0.11) uses ``Rcp / Lcp`` when ``num_blocks >= Rcp`` and otherwise counts the blocks
    on ``c`` among ``[prefix, prefix + num_blocks)``. Both equal ours when D has no prefix hit;
    with a prefix hit upstream can expect DONEs from P ranks that hold nothing to send, so D waits
    until the abort timeout. We count actual senders.

    Args:
        p: P's layout (``pd_head_ratio`` taken from it).
        d: D's layout.
        hosts: D hosts (see `d_block_location`).
        base_port: D's advertised base port.
        num_blocks: Prompt blocks, ``ceil(prompt_len / block_size)``.
        prefix_blocks: Blocks already on D, ``ceil(remote_cache_tokens / block_size)``.

    Returns:
        ``{endpoint: count}`` for every D rank (all head groups).

    Raises:
        ConfigError: ``hosts`` is empty.
    """
    if not hosts:
        raise ConfigError("d_hosts", list(hosts), "at least one D host")
    rcp, lcp = p.cp_size, d.cp_size
    senders = [0] * lcp
    for q in range(rcp):
        first = prefix_blocks + (q - prefix_blocks) % rcp  # first block >= prefix on P CP rank q
        if first < num_blocks:
            senders[q % lcp] += 1
    counts: dict[Endpoint, int] = {}
    for pcp_rank in range(d.pcp_size):
        for tp_rank in range(d.tp_size):
            world = pcp_rank * d.tp_size + tp_rank
            endpoint = Endpoint(hosts[len(hosts) * world // d.world_size], base_port + world)
            counts[endpoint] = senders[d.cp_index(pcp_rank, d.dcp_rank(tp_rank))] * p.pd_head_ratio
    return counts
