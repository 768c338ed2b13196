"""Capacity formulas with worked numbers, and config errors naming the key."""

from __future__ import annotations

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_offload.capacity import native_capacity, normalise_legacy_native_config, per_rank_capacity
from ascend_dist.kv_offload.ucm import UcmUnavailable, load_dispatcher_class


def test_native_unit_and_realistic_examples() -> None:
    unit = native_capacity(40960, 64, 2, 2)
    assert (unit.chunk_bytes, unit.aligned_chunk_bytes, unit.num_chunks) == (256, 4096, 10)
    qwen = native_capacity(4 << 30, 20 << 20, 1, 8)  # 40 layers x K/V x 256 KiB, k 8
    assert qwen.chunk_bytes == 160 << 20 and qwen.num_chunks == 25


def test_legacy_translation_copies_the_config() -> None:
    raw = {"num_cpu_blocks": 10, "other": 1}
    config, forced = normalise_legacy_native_config(raw, 64, 2, 2)
    assert config == {"num_cpu_blocks": 10, "other": 1, "cpu_bytes_to_use": 40960} and forced is None
    assert raw == {"num_cpu_blocks": 10, "other": 1}
    config, forced = normalise_legacy_native_config(raw, 0, 2, 2)
    assert config["cpu_bytes_to_use"] == 1 and forced == 10
    config, _ = normalise_legacy_native_config({"cpu_bytes_to_use": "1 MiB", "num_cpu_blocks": 3}, 64, 1)
    assert config["cpu_bytes_to_use"] == 1 << 20


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({}, "cpu_bytes_to_use"),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks"),
        ({"cpu_bytes_to_use": "12 furlongs"}, "cpu_bytes_to_use"),
    ],
)
def test_bad_native_config_names_the_key(raw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        normalise_legacy_native_config(raw, 64, 1)


def test_per_rank_and_zero_capacity() -> None:
    assert per_rank_capacity({"cpu_bytes_to_use": "8 GiB"}, 4) == 2 << 30
    assert per_rank_capacity({}, 1) == 8 << 30
    with pytest.raises(ConfigError, match="cpu_bytes_to_use"):
        per_rank_capacity({"cpu_bytes_to_use": 0}, 1)
    with pytest.raises(ConfigError, match="blocks_per_chunk"):
        native_capacity(4096, 64, 1, 0)


def test_ucm_not_installed_here_says_how_to_install() -> None:
    with pytest.raises(UcmUnavailable, match="pip install uc-manager"):
        load_dispatcher_class()
