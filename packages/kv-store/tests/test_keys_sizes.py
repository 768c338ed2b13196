"""Keys, sizes, families, partitions and configuration: worked numeric examples as tables."""

from __future__ import annotations

import json

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_store.assembly import PoolSpec
from ascend_dist.kv_store.config.config import MooncakeStoreConfig, PoolConfig, YuanrongConfig
from ascend_dist.kv_store.config.sizes import DerivedSizes, cache_family, pp_layer_partition
from ascend_dist.kv_store.keys.keys import (
    KeyMetadata,
    RankLayout,
    gva_block_key,
    gva_partial_key,
    normalize_model_name,
    put_step_and_head,
    rank_position,
)

H = "3f9a" + "0" * 58 + "c2"


def test_pool_key_exact_format() -> None:
    meta = KeyMetadata(model_name="/models/Qwen3-8B/", head_or_tp_rank=1)
    assert meta.pool_key(H) == (
        f"Qwen3-8B@pcp0@dcp0@head_or_tp_rank:1@pp_rank:0@group:0@cache_role:kv@cache_family:default@{H}"
    )
    assert meta.pool_key(bytes.fromhex(H)) == meta.pool_key(H)
    assert meta.partial_key(H, 8) == meta.pool_key(H) + "@partial:8"


def test_layer_key_has_pp_rank_and_differs_per_stage() -> None:
    m0 = KeyMetadata(model_name="m", pp_rank=0)
    m1 = KeyMetadata(model_name="m", pp_rank=1)
    assert m0.layer_key("ab", 3) == (
        "m@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default@layer_id:3@ab"
    )
    assert m0.layer_key("ab", 0) != m1.layer_key("ab", 0)
    assert m0.layer_keys("ab", 2) == [m0.layer_key("ab", 0), m0.layer_key("ab", 1)]


@pytest.mark.parametrize(
    ("model", "name"), [("Qwen/Qwen3-8B", "Qwen3-8B"), ("/m/Qwen3-8B/", "Qwen3-8B"), ("/m/Qwen3-8B", "Qwen3-8B")]
)
def test_model_name_identical_on_both_sides(model: str, name: str) -> None:
    assert normalize_model_name(model) == name
    assert gva_block_key(model, "ab", 0) == f"{name}@ab@0"
    assert gva_block_key(model, "ab", 1, group=2) == f"{name}@2@ab@1"
    assert gva_partial_key(model, "r1", group=0, block_index=3, end_token=50, head=1) == f"{name}@partial@r1@0@3@50@1"


def test_model_name_empty_rejected() -> None:
    with pytest.raises(ConfigError, match="model"):
        normalize_model_name("///")


@pytest.mark.parametrize(
    ("tp", "rank", "heads", "mla", "expected"),
    [(8, 5, 1, True, (8, 0)), (4, 3, 8, False, (1, 3)), (8, 5, 2, False, (4, 1)), (2, 1, 8, False, (1, 1))],
)
def test_put_step_and_head(tp: int, rank: int, heads: int, mla: bool, expected: tuple[int, int]) -> None:
    assert put_step_and_head(tp, rank, heads, mla) == expected


def test_rank_expansion_counts_and_order() -> None:
    layout = RankLayout(tp_size=4, pp_size=2, num_kv_heads=8)
    keys = layout.expand(KeyMetadata(model_name="m"), ["a", "b", "c"])
    assert len(keys) == 24
    assert keys[0].endswith("head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default@a")
    assert keys[3].endswith("head_or_tp_rank:1@pp_rank:0@group:0@cache_role:kv@cache_family:default@a")
    assert "pp_rank:1" in keys[12]
    # CP ranks are expanded too (upstream checked only pcp0/dcp0).
    cp = RankLayout(tp_size=2, dcp_size=2, num_kv_heads=2)
    assert {k.split("@")[2] for k in cp.expand(KeyMetadata(model_name="m"), ["a"])} == {"dcp0", "dcp1"}
    assert RankLayout(tp_size=8, num_kv_heads=4, use_mla=True).num_variants(0) == 1


@pytest.mark.parametrize(
    ("blocks", "cp", "pmu", "hash_block", "lcm"),
    [
        ([128], 1, None, 128, 128),
        ([128], 2, None, 256, 256),
        ([128, 128], 1, 64, 64, 128),
        ([128, 512, 16384], 1, None, 128, 16384),
    ],
)
def test_derived_sizes(blocks: list[int], cp: int, pmu: int | None, hash_block: int, lcm: int) -> None:
    sizes = DerivedSizes.compute(blocks, dcp_size=cp, prefix_match_unit=pmu)
    assert (sizes.hash_block_size, sizes.lcm_block_size, sizes.granularity) == (hash_block, lcm, lcm)


def test_dsv4_prompt_floor() -> None:
    sizes = DerivedSizes.compute([128, 512, 16384])
    assert 40000 // sizes.granularity * sizes.granularity == 32768


def test_derived_sizes_reject_non_multiple() -> None:
    with pytest.raises(ConfigError, match="prefix_match_unit"):
        DerivedSizes.compute([128, 96], prefix_match_unit=64)


@pytest.mark.parametrize(
    ("ratios", "family"),
    [([], "default"), ([None], "default"), ([1], "c1"), ([0.5], "c1"), ([4, 4], "c4"), ([4, 128], "mixed")],
)
def test_cache_family(ratios: list[float | None], family: str) -> None:
    assert cache_family(ratios) == family


@pytest.mark.parametrize(
    ("layers", "pp", "parts"), [(61, 4, [15, 15, 16, 15]), (62, 4, [15, 16, 16, 15]), (61, 2, [31, 30]), (8, 1, [8])]
)
def test_pp_partition(layers: int, pp: int, parts: list[int]) -> None:
    assert pp_layer_partition(layers, pp) == parts


def test_pp_partition_explicit() -> None:
    assert pp_layer_partition(61, 2, "30,31") == [30, 31]
    with pytest.raises(ConfigError, match="prefill_pp_layer_partition"):
        pp_layer_partition(61, 2, "30,30")


def test_pool_config_defaults_and_errors() -> None:
    cfg = PoolConfig.from_extra({"backend": "MoonCake", "mooncake_rpc_port": "5555"})
    assert (cfg.backend, cfg.lookup_rpc_port, cfg.discard_partial_chunks) == ("mooncake", 5555, True)
    with pytest.raises(ConfigError, match="backend") as exc:
        PoolConfig.from_extra({"backend": "redis"})
    assert "mooncake" in str(exc.value)
    with pytest.raises(ConfigError, match="load_async"):
        PoolConfig.from_extra({"load_async": "maybe"})
    with pytest.raises(ConfigError, match="kv_role"):
        PoolConfig.from_extra({}, kv_role="kv_sideways")
    consumer = PoolConfig.from_extra({"consumer_is_to_load": True}, kv_role="kv_consumer")
    assert consumer.can_load and not consumer.can_save


def test_several_kv_groups_load_asynchronously(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM takes a multi-group model's load failures only per request, from async loads."""
    cfg = PoolConfig.from_extra({})
    assert cfg.for_groups(1) is cfg and not cfg.async_loads  # one group: unchanged (block-level reports)
    with caplog.at_level("INFO", logger="ascend_dist.kv_store.config.config"):
        hybrid = cfg.for_groups(4)  # 4: no other test's model (the once-per-process key holds the count)
        assert cfg.for_groups(4) is not cfg
    assert sum("load_async=true" in r.getMessage() for r in caplog.records) == 1
    assert hybrid.async_loads and hybrid.load_async and hybrid.backend == cfg.backend
    assert hybrid.for_groups(4) is hybrid
    with pytest.raises(ConfigError, match=r"use_layerwise.*load_async"):
        PoolConfig.from_extra({"use_layerwise": True}).for_groups(3)
    assert PoolConfig.from_extra({"use_layerwise": True}).for_groups(1).use_layerwise


@pytest.mark.parametrize(
    ("size", "expected"), [("1GB", 1 << 30), ("1.5 mb", 1572864), ("1024", 1024), (2048, 2048), ("512 MiB", 512 << 20)]
)
def test_mooncake_sizes(size: str | int, expected: int) -> None:
    cfg = MooncakeStoreConfig.load({"master_server_address": "127.0.0.1:1", "global_segment_size": size}, env={})
    assert cfg.global_segment_size == expected


def test_mooncake_config_errors_name_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match="global_segment_size"):
        MooncakeStoreConfig.load({"master_server_address": "h:1", "global_segment_size": "abc"}, env={})
    with pytest.raises(ConfigError, match="master_server_address"):
        MooncakeStoreConfig.load({"metadata_server": "P2PHANDSHAKE"}, env={})
    with pytest.raises(ConfigError, match="protocol"):
        MooncakeStoreConfig.load({"master_server_address": "h:1", "protocol": "carrier-pigeon"}, env={})
    with pytest.raises(ConfigError, match="MOONCAKE_CONFIG_PATH"):
        MooncakeStoreConfig.load(None, env={})
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "h:1", "local_buffer_size": "1KB"}))
    cfg = MooncakeStoreConfig.load(
        None,
        env={
            "MOONCAKE_CONFIG_PATH": str(path),
            "MOONCAKE_MASTER": "127.0.0.1:9",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2GB",
        },
    )
    assert (cfg.master_server_address, cfg.global_segment_size, cfg.local_buffer_size) == ("127.0.0.1:9", 2 << 30, 1024)


def test_yuanrong_config(tmp_path) -> None:
    path = tmp_path / "yr.json"
    path.write_text(json.dumps({"worker_addr": "127.0.0.1:31501"}))
    cfg = YuanrongConfig.load(None, env={"YR_CONFIG_PATH": str(path)})
    assert (cfg.host, cfg.port, cfg.connect_timeout_ms) == ("127.0.0.1", 31501, 9000)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="YR_CONFIG_PATH"):
        YuanrongConfig.load(None, env={"YR_CONFIG_PATH": str(path)})
    with pytest.raises(ConfigError, match="worker_addr"):
        YuanrongConfig.load({"worker_addr": "nohost"})


def test_mla_dcp_over_tp_and_pcp_keys_every_rank_once() -> None:
    """MLA, DCP spanning TP x PCP: every rank holds its own token shard, so each writes all its chunks."""
    specs = [
        PoolSpec(model="m", block_sizes=(16,), num_kv_heads=1, use_mla=True, tp_size=4, pcp_size=2, dcp_size=8,
                 tp_rank=p.tp_rank, pcp_rank=p.pcp_rank, dcp_rank=p.dcp_rank)
        for p in (rank_position(r, tp_size=4, pcp_size=2, dcp_size=8) for r in range(8))
    ]  # fmt: skip
    prefixes = {s.key_metadata()[0].prefix for s in specs}
    assert len(prefixes) == 8 == specs[0].rank_layout().num_variants(0)
    assert {s.write_shard() for s in specs} == {(0, 1)}
    assert [s.dcp_rank for s in specs] == [0, 2, 4, 6, 1, 3, 5, 7]  # TP-major, PCP-minor, as vLLM reads it


def test_dcp_splits_tp_replica_sets() -> None:
    """GQA 2 heads, TP 8, DCP 2: four TP ranks per head, two per (head, DCP shard) share the writing."""
    shards = [
        PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2, tp_size=8, dcp_size=2, tp_rank=t, dcp_rank=t % 2)
        for t in range(8)
    ]
    assert [s.write_shard() for s in shards] == [(0, 2), (0, 2), (1, 2), (1, 2)] * 2
    assert [s.write_rank() % s.put_step() for s in shards] == [0, 0, 1, 1] * 2
    with pytest.raises(ConfigError, match="dcp_rank"):
        PoolSpec(model="m", block_sizes=(16,), num_kv_heads=2, tp_size=8, dcp_size=2, tp_rank=1, dcp_rank=0).put_step()
