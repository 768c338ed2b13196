"""Which D block pairs with which P block, per KV group kind (full attention, sliding window, state).

Runs in: D worker processes (and tests). No I/O, no threads, no torch.

P lends a sliding-window group only its last ``window_blocks`` non-null blocks
(`ascend_dist.kv_mooncake.core.blocks.trim_block_ids`), so the full-attention rule (skip P's
blocks from the head by D's prefix hit) would misalign them: `pair_swa_blocks` clips D's list to
the prompt and the same window, drops vLLM's null block 0, and pairs both lists by their tails
(each ends at the prompt's last block). A state group pairs one block per request
(`state_block_pair`). `pair_group_blocks` picks the rule for a group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.blocks import plan_block_pairs
from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta

__all__ = ["pair_group_blocks", "pair_swa_blocks", "state_block_pair"]

NULL_BLOCK = 0
"""vLLM's placeholder block id for positions outside a sliding window."""


def pair_swa_blocks(
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    *,
    num_computed_tokens: int,
    prompt_len: int,
    block_size: int,
    window_blocks: int,
) -> tuple[list[int], list[int]]:
    """Pair D's and P's blocks of a sliding-window group by their tails.

    Args:
        local_ids: D's new blocks of the group, from its prefix hit on (may hold null blocks and
            lookahead blocks past the prompt).
        remote_ids: P's trimmed list (the last ``window_blocks`` non-null prompt blocks).
        num_computed_tokens: D's prefix hit in tokens.
        prompt_len: Prompt tokens (0: unknown, no prompt clip on D).
        block_size: Tokens per block.
        window_blocks: ``ceil(window / block) + 1``.

    Returns:
        ``(local, remote)`` of equal length; the last entries of both are the prompt's last block.

    Example:
        Prompt 80 tokens (blocks 0..4), block 16, window 3: P sends ``[42, 43, 44]`` (blocks 2..4).
        D has a prefix hit of 32 tokens and new blocks ``[20, 21, 22]`` (blocks 2..4) ->
        ``([20, 21, 22], [42, 43, 44])``; the head-skip rule would pair block 20 with P's 44.
    """
    if block_size <= 0:
        raise ConfigError("block_size", block_size, "a positive int")
    if window_blocks <= 0:
        raise ConfigError("window_blocks", window_blocks, "a positive int for a sliding-window group")
    if num_computed_tokens < 0:
        raise ConfigError("num_computed_tokens", num_computed_tokens, "an int >= 0")
    local = list(local_ids)
    if prompt_len > 0:
        local = local[: max(0, math.ceil(prompt_len / block_size) - num_computed_tokens // block_size)]
    local = [b for b in local[-window_blocks:] if b != NULL_BLOCK]
    remote = [b for b in remote_ids if b != NULL_BLOCK]
    n = min(len(local), len(remote))
    return (local[len(local) - n :], remote[len(remote) - n :]) if n else ([], [])


def pair_group_blocks(meta: ReqMeta, group: int, block_size: int) -> tuple[list[int], list[int]]:
    """D's and P's block ids of one KV group.

    A state group pairs its one state block (`state_block_pair`), a sliding-window group is
    tail-aligned (`pair_swa_blocks`), a full-attention group skips D's prefix hit.
    """
    window = meta.window_blocks[group] if group < len(meta.window_blocks) else 0
    local, remote = meta.local_block_ids[group], meta.remote_block_ids[group]
    if group in meta.state_groups:
        pair = state_block_pair(local, remote, meta.num_speculative_tokens)
        return ([pair[0]], [pair[1]]) if pair else ([], [])
    if window > 0:
        return pair_swa_blocks(
            local,
            remote,
            num_computed_tokens=meta.num_computed_tokens,
            prompt_len=meta.prompt_len,
            block_size=block_size,
            window_blocks=window,
        )
    return plan_block_pairs(local, remote, meta.num_computed_tokens, block_size)


def state_block_pair(
    local_ids: Sequence[int], remote_ids: Sequence[int], num_speculative_tokens: int = 0
) -> tuple[int, int] | None:
    """The one (local, remote) block of a state group, or None if empty.

    Remote index ``len(remote) - num_speculative_tokens - 1``, local ``local_ids[0]`` (D may
    allocate a different number of blocks; never force equal counts). vLLM's null block 0 (the
    padding of a Mamba group's row) is never a destination.
    """
    local_ids = [b for b in local_ids if b != NULL_BLOCK]
    if not local_ids or not remote_ids:
        return None
    idx = len(remote_ids) - num_speculative_tokens - 1
    if idx < 0:
        raise ConfigError("num_speculative_tokens", num_speculative_tokens, f"< {len(remote_ids)} (P's state blocks)")
    return local_ids[0], remote_ids[idx]
