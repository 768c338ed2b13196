"""Context parallelism: every (pp, pcp, tp) worker of vLLM's real configs keys its own KV, and a saved prefix hits.

The expected ranks come from vLLM 0.33's own group layout: `_vllm_groups` repeats the tensor
reshapes of ``vllm.distributed.parallel_state.initialize_model_parallel`` (which needs a live
process group, so it cannot be called here). The specs come from `pool_spec_from_vllm` over a real
``VllmConfig`` whose ``parallel_config.rank`` is set as vLLM's ``WorkerBase`` sets it. Every rank
then stores the chunks it writes into a real Mooncake Store and rank 0's `PoolLookup` asks for the
prompt: a hit only when every rank variant it expands exists.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from vllm.config import ParallelConfig  # noqa: E402

from ascend_dist.common.errors import ConfigError  # noqa: E402
from ascend_dist.kv_store.assembly import PoolSpec  # noqa: E402
from ascend_dist.kv_store.backends.mooncake import MooncakeBackend  # noqa: E402
from ascend_dist.kv_store.config.config import MooncakeStoreConfig  # noqa: E402
from ascend_dist.kv_store.keys.keys import RankPosition, rank_position  # noqa: E402
from ascend_dist.kv_store.lookup.pool_lookup import PoolLookup  # noqa: E402
from ascend_dist.kv_store.vllm_spec import pool_spec_from_vllm, rank_position_from_vllm  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]

# (tp, pp, pcp, dcp) that vLLM 0.33 accepts for the tiny Llama (2 KV heads, 8 query heads):
# DCP reusing TP ranks (alone, and splitting TP replica sets), PCP alone with PP (where the old
# pp_rank was wrong), DCP spanning PCP, and no CP (control).
LAYOUTS = [(4, 1, 1, 2), (8, 1, 1, 2), (2, 2, 2, 1), (4, 2, 2, 2), (8, 1, 2, 2), (4, 1, 1, 1)]


def _vllm_groups(tp: int, pp: int, pcp: int, dcp: int) -> dict[int, RankPosition]:
    """Each rank's rank in its TP/PCP/DCP/PP group, built as vLLM 0.33's initialize_model_parallel does."""
    all_ranks = torch.arange(tp * pp * pcp).reshape(-1, 1, pp, pcp, tp)  # ExternalDP x DP x PP x PCP x TP
    groups = {
        "tp": all_ranks.view(-1, tp).unbind(0),
        "dcp": (all_ranks.transpose(-1, -2) if dcp > 1 else all_ranks).reshape(-1, dcp).unbind(0),
        "pcp": all_ranks.transpose(3, 4).reshape(-1, pcp).unbind(0),
        "pp": all_ranks.transpose(2, 4).reshape(-1, pp).unbind(0),
    }
    where: dict[str, dict[int, int]] = defaultdict(dict)
    for kind, lists in groups.items():
        for group in lists:
            members = group.tolist()
            for r in members:
                where[kind][r] = members.index(r)
    return {
        r: RankPosition(
            tp_rank=where["tp"][r], pcp_rank=where["pcp"][r], dcp_rank=where["dcp"][r], pp_rank=where["pp"][r]
        )
        for r in range(tp * pp * pcp)
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 8 query heads over 2 KV heads: TP 8 and DCP 2 (query heads per KV head divisible by DCP) are legal
    return vb.write_model_dir(tmp_path_factory.mktemp("tiny-llama-cp"), num_attention_heads=8, hidden_size=128)


def _specs(model_dir: Path, tp: int, pp: int, pcp: int, dcp: int) -> list[PoolSpec]:
    config = vb.cpu_vllm_config(model_dir, None)
    config.parallel_config = ParallelConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
    )
    config.model_config.verify_with_parallel_config(config.parallel_config)  # vLLM's own checks of the layout
    kcc = vb.kv_cache_config([(LAYERS, vb.attention_spec(2, 16))])
    specs = []
    for rank in range(tp * pp * pcp):
        config.parallel_config.rank = rank  # as vLLM's WorkerBase.__init__ sets it
        specs.append(pool_spec_from_vllm(config, kcc))
    return specs


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_each_rank_gets_vllms_ranks_and_its_own_keys(model_dir, layout: tuple[int, int, int, int]) -> None:
    specs = _specs(model_dir, *layout)
    expected = _vllm_groups(*layout)
    got = {r: RankPosition(s.tp_rank, s.pcp_rank, s.dcp_rank, s.pp_rank) for r, s in enumerate(specs)}
    assert got == expected
    # ranks holding different KV (another pcp, dcp, pp or KV head) write different keys; replicas the same
    by_prefix: dict[str, set[tuple[int, int, int, int]]] = defaultdict(set)
    for s in specs:
        meta = s.key_metadata()[0]
        assert f"@pcp{s.pcp_rank}@dcp{s.dcp_rank}@" in meta.prefix and f"@pp_rank:{s.pp_rank}@" in meta.prefix
        by_prefix[meta.prefix].add((s.pcp_rank, s.dcp_rank, s.pp_rank, meta.head_or_tp_rank))
    assert all(len(v) == 1 for v in by_prefix.values())
    assert len(by_prefix) == specs[0].rank_layout().num_variants(0)  # lookups expand exactly the written variants


def _save(
    specs: list[PoolSpec], backend: MooncakeBackend, hashes: list[bytes], tokens: int, buf: np.ndarray
) -> list[str]:
    """Store every chunk each of ``specs``' workers writes (its `write_shard` of the chunks), under its keys."""
    written: list[str] = []
    for s in specs:
        db = s.token_db()
        size = s.put_step()
        keys = [db.key(c) for c in db.iter_chunks(tokens, hashes, 0, shard_rank=s.write_rank() % size, shard_size=size)]
        if keys:
            assert backend.put(keys, [[buf.ctypes.data]] * len(keys), [[64]] * len(keys)) == [0] * len(keys)
        written += keys
    return written


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_a_fully_saved_prefix_hits_for_every_layout(model_dir, mooncake_master, layout: tuple[int, ...]) -> None:
    specs = _specs(model_dir, *layout)
    sizes = specs[0].sizes()
    tokens = 4 * sizes.granularity
    tag = os.urandom(4)
    hashes = [tag + i.to_bytes(28, "big") for i in range(tokens // sizes.hash_block_size)]
    backend = MooncakeBackend(MooncakeStoreConfig.load(mooncake_master.config(), env={}))
    buf = np.arange(4096, dtype=np.uint8)
    backend.register_buffer([buf.ctypes.data], [buf.nbytes])
    try:
        lookup = PoolLookup(
            token_db=specs[0].token_db(), layout=specs[0].rank_layout(), backend=backend, granularity=sizes.granularity
        )
        assert lookup.lookup(tokens, hashes) == 0  # control: nothing saved yet
        written = _save(specs[:-1], backend, hashes, tokens, buf)
        if len(specs) > 1:
            assert lookup.lookup(tokens, hashes) < tokens  # control: the last rank's chunks are still missing
        written += _save(specs[-1:], backend, hashes, tokens, buf)
        assert lookup.lookup(tokens, hashes) == tokens  # every rank's chunks are found: a full hit
        assert len(set(written)) == len(written)  # replicas split the chunks: no key is written twice
        chunks = tokens // specs[0].token_db().block_sizes[0]
        assert len(written) == specs[0].rank_layout().num_variants(0) * chunks  # each variant's chunks, once
    finally:
        backend.close()


def test_rank_position_rejects_impossible_layouts() -> None:
    with pytest.raises(ConfigError, match="dcp_size"):
        rank_position(0, tp_size=2, pcp_size=1, dcp_size=4)
    with pytest.raises(ConfigError, match="rank"):
        rank_position(8, tp_size=2, pp_size=2, pcp_size=2)


def test_vllm_groups_must_agree_with_the_derived_ranks(model_dir) -> None:
    config = vb.cpu_vllm_config(model_dir, None)
    config.parallel_config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    config.parallel_config.rank = 3
    assert rank_position_from_vllm(config) == RankPosition(tp_rank=1, pcp_rank=0, dcp_rank=0, pp_rank=1)
    same = RankPosition(tp_rank=1, pcp_rank=0, dcp_rank=0, pp_rank=1)
    assert rank_position_from_vllm(config, groups=lambda: same) == same
    with pytest.raises(ConfigError, match="vLLM's groups"):
        rank_position_from_vllm(config, groups=lambda: RankPosition(tp_rank=1, pcp_rank=0, dcp_rank=0, pp_rank=0))
