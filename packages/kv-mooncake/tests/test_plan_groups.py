"""SWA tail alignment on D and state-group descriptors."""

from __future__ import annotations

import numpy as np
import pytest

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.kv_mooncake.core.blocks import plan_block_pairs, trim_block_ids
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.pull.block_pairs import pair_swa_blocks, state_block_pair
from ascend_dist.kv_mooncake.pull.state_bytes import StateGeom, state_descriptors


def _swa(
    local: list[int], remote: list[int], computed: int, prompt: int, window: int = 3
) -> tuple[list[int], list[int]]:
    return pair_swa_blocks(
        local, remote, num_computed_tokens=computed, prompt_len=prompt, block_size=16, window_blocks=window
    )


def test_swa_prefix_hit_aligns_tails_not_heads() -> None:
    p_blocks = [40, 41, 42, 43, 44]  # prompt blocks 0..4 on P
    remote = trim_block_ids(p_blocks, 80, 16, 3)
    assert remote == [42, 43, 44]
    # D has a prefix hit of 2 blocks; its new blocks are prompt blocks 2..4.
    assert _swa([20, 21, 22], remote, 32, 80) == ([20, 21, 22], [42, 43, 44])
    # The full-attention rule would pair D's block 2 with P's block 4: the bug this fixes.
    assert plan_block_pairs([20, 21, 22], remote, 32, 16) == ([20], [44])
    # Prefix hit inside the window: only the missing tail is pulled.
    assert _swa([23, 24], remote, 48, 80) == ([23, 24], [43, 44])


def test_swa_d_clips_to_window_prompt_and_null_blocks() -> None:
    remote = trim_block_ids([0, 10, 11, 12, 13], 80, 16, 3)
    assert remote == [11, 12, 13]
    # No prefix hit: D's list has nulls outside the window and a lookahead block past the prompt.
    assert _swa([0, 0, 30, 31, 32, 99], remote, 0, 80) == ([30, 31, 32], [11, 12, 13])
    # Short prompt: P's window holds a null block it dropped.
    assert trim_block_ids([0, 10, 11, 12, 13], 32, 16, 3) == [10]
    assert _swa([0, 50], [10], 0, 32) == ([50], [10])
    assert _swa([], [10], 0, 32) == ([], [])
    with pytest.raises(ConfigError, match="window_blocks"):
        _swa([1], [1], 0, 16, window=0)


def test_state_block_pair() -> None:
    assert state_block_pair([7, 8], [20, 21, 22]) == (7, 22)
    assert state_block_pair([7], [20, 21, 22], num_speculative_tokens=1) == (7, 21)
    assert state_block_pair([], [1]) is None
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        state_block_pair([1], [2], num_speculative_tokens=1)


def test_state_ratio_1_two_descriptors() -> None:
    loc = StateGeom(0x1000, 512, 256, 0x9000, 1024, 1024)
    rem = StateGeom(0x4000, 256, 256, 0xC000, 2048, 1024)
    d = state_descriptors(loc, rem, 3, 5)
    assert d.local.tolist() == [0x1000 + 3 * 512, 0x9000 + 3 * 1024]
    assert d.remote.tolist() == [0x4000 + 5 * 256, 0xC000 + 5 * 2048]
    assert d.lengths.tolist() == [256, 1024]


def _geometry(ratio: int, rows: int, sk: int, sv: int, elt: int) -> tuple[StateGeom, StateGeom]:
    w_p, ssm_p = 2 * sk + sv, 64
    conv_p = rows * w_p * elt
    rem = StateGeom(0, conv_p, conv_p, 4 * conv_p, ssm_p, ssm_p)
    loc = StateGeom(0, ratio * conv_p, ratio * conv_p, 4 * ratio * conv_p, ratio * ssm_p, ratio * ssm_p)
    return loc, rem


def test_state_ratio_gt_1_spec_example() -> None:
    """nk=16, dk=128, nv=32, dv=128, P4 -> D2: row 1, V segment, k=1 -> P elem 3072, D elem 7168."""
    elt, rows = 2, 4
    loc, rem = _geometry(2, rows, 512, 1024, elt)
    d = state_descriptors(loc, rem, 0, 0, ratio=2, offset=1, conv_rows=rows, key_size=512, value_size=1024, elt=elt)
    assert len(d) == rows * 3 + 1
    i = 1 * 3 + 2
    assert (int(d.remote[i]), int(d.local[i]), int(d.lengths[i])) == (3072 * elt, 7168 * elt, 1024 * elt)
    assert (int(d.local[-1]), int(d.remote[-1]), int(d.lengths[-1])) == (loc.ssm_base + 64, rem.ssm_base, 64)


def _apply(dst: np.ndarray, src: np.ndarray, d: Descriptors) -> None:
    for lo, re_, n in zip(d.local.tolist(), d.remote.tolist(), d.lengths.tolist(), strict=True):
        dst[lo : lo + n] = src[re_ : re_ + n]


@pytest.mark.parametrize("ratio", [2, 4])
def test_state_ratio_gt_1_byte_exact(ratio: int) -> None:
    """D's conv row = [Q of its P ranks | K of its P ranks | V of its P ranks]; ssm stacked by rank."""
    rows, sk, sv, elt = 3, 4, 6, 2
    loc, rem = _geometry(ratio, rows, sk, sv, elt)
    rng = np.random.default_rng(ratio)
    p_bufs = [rng.integers(0, 255, 4 * rem.conv_len + rem.ssm_len + 64, dtype=np.uint8) for _ in range(ratio)]
    d_buf = np.zeros(4 * loc.conv_len + loc.ssm_len, dtype=np.uint8)
    for k, buf in enumerate(p_bufs):
        d = state_descriptors(
            loc, rem, 0, 0, ratio=ratio, offset=k, conv_rows=rows, key_size=sk, value_size=sv, elt=elt
        )
        _apply(d_buf, buf, d)
    conv_p = [b[: rem.conv_len].reshape(rows, 2 * sk + sv, elt) for b in p_bufs]
    want = np.concatenate(
        [
            np.concatenate([c[:, a:b] for c in conv_p], axis=1)
            for a, b in ((0, sk), (sk, 2 * sk), (2 * sk, 2 * sk + sv))
        ],
        axis=1,
    )
    assert np.array_equal(d_buf[: loc.conv_len].reshape(rows, -1, elt), want)
    ssm = d_buf[loc.ssm_base : loc.ssm_base + loc.ssm_len]
    assert np.array_equal(ssm, np.concatenate([b[rem.ssm_base : rem.ssm_base + rem.ssm_len] for b in p_bufs]))


def test_state_bad_sizes() -> None:
    loc, rem = _geometry(2, 2, 4, 4, 2)
    with pytest.raises(LayoutError, match="conv_len"):
        state_descriptors(loc, rem, 0, 0, ratio=2, conv_rows=3, key_size=4, value_size=4, elt=2)
    with pytest.raises(ConfigError, match="remote_tp_offset"):
        state_descriptors(loc, rem, 0, 0, ratio=2, offset=2, conv_rows=2, key_size=4, value_size=4, elt=2)
    with pytest.raises(LayoutError, match="state lengths"):
        state_descriptors(loc, rem, 0, 0)
