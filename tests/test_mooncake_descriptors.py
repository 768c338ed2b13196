"""ascend_dist.common's regions and descriptors driving the real Mooncake engine across two processes.

The remote process owns a split K/V cache (Ascend layout: separate K and V tensors at a non-zero
storage offset); this process pulls scattered blocks with `batch_transfer_sync_read` using descriptors
built by `build_layer_descriptors`, and checks every byte against what the remote wrote.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_cache import SplitKVCache
from peers import JsonPeer

from ascend_dist.kv_mooncake.core.descriptors import build_layer_descriptors, split_descriptors_by_limit

pytestmark = pytest.mark.mooncake

SEED = 7


@pytest.fixture
def engine():
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return te


def _pull(engine, *, layers: int, blocks: int, block_bytes: int, local_ids, remote_ids) -> tuple[SplitKVCache, int]:
    peer = JsonPeer("kv_peer.py", "--layers", str(layers), "--blocks", str(blocks),
                    "--block-bytes", str(block_bytes), "--seed", str(SEED))  # fmt: skip
    local = SplitKVCache(layers, blocks, block_bytes)
    regions = local.register(engine)
    try:
        hello = peer.read(timeout=60)
        assert "error" not in hello, hello
        # K and V of a layer share one allocation: one merged region per layer, on both sides.
        assert hello["regions"] == layers == len(regions.ptrs)
        descriptors = build_layer_descriptors(
            np.asarray(local.bases()), np.asarray(hello["bases"]), local_ids, remote_ids, block_len=block_bytes
        )
        batches = split_descriptors_by_limit(descriptors)
        for batch in batches:
            rc = engine.batch_transfer_sync_read(
                hello["session"], batch.local.tolist(), batch.remote.tolist(), batch.lengths.tolist()
            )
            assert rc == 0, f"batch_transfer_sync_read returned {rc}"
        return local, len(batches)
    finally:
        local.unregister(engine, regions)
        assert peer.close() == 0


def _assert_pulled(local: SplitKVCache, local_ids, remote_ids) -> None:
    for index, tensor in enumerate(local.tensors()):
        expected = local.expected(SEED, index)
        assert torch.equal(tensor[list(local_ids)], expected[list(remote_ids)]), f"tensor {index} differs"
        untouched = sorted(set(range(local.blocks)) - set(local_ids))
        assert not tensor[untouched].any(), f"tensor {index}: bytes landed outside the requested blocks"


def test_scattered_blocks_of_every_layer_arrive_byte_for_byte(engine):
    rng = np.random.default_rng(0)
    remote_ids = rng.permutation(64)[:40]
    local_ids = np.concatenate([np.arange(3, 23), np.arange(30, 50)])  # contiguous runs merge locally
    local, batches = _pull(engine, layers=4, blocks=64, block_bytes=8192, local_ids=local_ids, remote_ids=remote_ids)
    assert batches == 1
    _assert_pulled(local, local_ids.tolist(), remote_ids.tolist())


def test_a_batch_above_the_tcp_piece_limit_is_split_and_still_complete(engine):
    # Every other block: nothing merges, 2 x 2,500 = 5,000 descriptors, above Mooncake TCP's 2,048 per batch.
    ids = np.arange(0, 5000, 2)
    local, batches = _pull(engine, layers=1, blocks=5000, block_bytes=256, local_ids=ids, remote_ids=ids)
    assert batches == 3
    _assert_pulled(local, ids.tolist(), ids.tolist())
