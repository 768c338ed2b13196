"""Every module imports without vLLM, torch or the library packages; the data helpers work bare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ascend_dist.testing import engines, hostile, vllm_builders


def test_modules_import_without_heavy_dependencies() -> None:
    # A fresh interpreter: this process may already hold torch from another test.
    code = (
        "import sys; import ascend_dist.testing.engines, ascend_dist.testing.hostile, "
        "ascend_dist.testing.ports, ascend_dist.testing.vllm_builders; "
        "print(sorted(m for m in ('vllm', 'torch', 'ascend_dist.cli', 'ascend_dist.kv_store') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_write_model_dir_applies_overrides(tmp_path: Path) -> None:
    vllm_builders.write_model_dir(tmp_path, num_key_value_heads=1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_key_value_heads"] == 1
    assert config["hidden_size"] == vllm_builders.TINY_LLAMA["hidden_size"]


def test_garbage_makers_change_only_their_key() -> None:
    good = {"remote_port": 1, "remote_host": "h"}
    assert hostile.with_(remote_port="abc")(good) == {"remote_port": "abc", "remote_host": "h"}
    assert hostile.without("remote_host")(good) == {"remote_port": 1}
    assert [g.name for g in hostile.flag("x")] == ["x-string", "x-int"]
    assert good == {"remote_port": 1, "remote_host": "h"}


def test_pool_arithmetic_counts_full_chunks_only() -> None:
    prompts = [[0] * n for n in engines.POOL_LENGTHS]
    assert engines.expected_hits(prompts) == [32, 96, 128]
    assert engines.full_chunks(prompts) == 1 + 3 + 4


def test_prompts_are_seeded() -> None:
    assert engines.make_prompts(7, (5, 9)) == engines.make_prompts(7, (5, 9))
    assert engines.make_prompts(7, (5,)) != engines.make_prompts(8, (5,))
    assert [len(p) for p in engines.make_prompts(1)] == [45, 64, 200, 333]
