"""A load that fails must not poison the pool through another request's save (the soak's first finding).

Through vLLM 0.33's real ``Scheduler`` on the prefix-caching instance, in runner order
(`pool_soak_support.SoakInstance`), over a real ``mooncake_master``: request X loads a pooled
prompt synchronously (sync and layer-wise modes) and vLLM caches X's blocks in the same
``schedule()``; request Y, sharing that prompt, hits those blocks from vLLM's prefix cache in the
same step and plans a save of their chunks from them. A store client evicts one of the chunks after
the lookup, so X's load of it fails and its block keeps the allocation sentinel. Y's save must not
store that block under the chunk's valid key: other instances would load it as a normal hit.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(300)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from pool_soak_support import (  # noqa: E402
    BLOCK,
    LAYERS,
    Counters,
    Failure,
    SoakInstance,
    classify_copy,
    expected_values,
    make_config,
    prefix_hashes,
)

from ascend_dist.kv_store.keys.keys import chunk_hash_hex  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402
from ascend_dist.testing.ports import free_port  # noqa: E402

MODES: dict[str, dict[str, Any]] = {"sync": {}, "layerwise": {"use_layerwise": True}}
NUM_BLOCKS = 32
EVICTED = 1  # the chunk evicted between the lookup and the load
RIGHT = "the pool's copy is right (the load did not write this block)"  # `classify_copy` of the right bytes
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vb.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def store_client(address: str) -> Any:
    """A Mooncake store client contributing no memory (the eviction)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
    return client


def _run(inst: SoakInstance, step_no: int, counters: Counters, failures: list[Failure], hook: Any = None) -> Any:
    return inst.step(step_no, counters, failures, on_scheduled=hook)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_block_whose_load_failed_is_never_saved_by_a_prefix_cache_hit(
    mode: str, model_dir: Path, mooncake_master: Any
) -> None:
    extra = MODES[mode]
    address = mooncake_master.address
    saver = SoakInstance(
        "saver", make_config(model_dir, address, free_port(), prefix_caching=False, num_blocks=NUM_BLOCKS, **extra),
        NUM_BLOCKS,
    )  # fmt: skip
    inst = SoakInstance(
        "cached", make_config(model_dir, address, free_port(), prefix_caching=True, num_blocks=NUM_BLOCKS, **extra),
        NUM_BLOCKS,
    )  # fmt: skip
    admin = store_client(address)
    counters, failures = Counters(), []
    base = 400 + 100 * list(MODES).index(mode)
    prompt = [base + i % 97 for i in range(3 * BLOCK + 5)]  # 3 whole chunks + 5 tokens
    meta = inst.scheduler.connector._spec.key_metadata()[0]  # type: ignore[union-attr]
    hashes = prefix_hashes(prompt[: (EVICTED + 1) * BLOCK])[EVICTED * BLOCK :]
    layers = [0] if mode == "layerwise" else range(len(LAYERS))
    seen: dict[str, Any] = {}

    def evict(_: SoakInstance, out: Any) -> None:
        reqs = {r.req_id: r for r in out.kv_connector_metadata.step.requests}
        x = reqs.get("x")
        if x is None or x.load_spec is None or not x.load_spec.can_load:
            return
        chunk = x.block_hashes[EVICTED]
        seen["chunk"], seen["x"], seen["y"] = chunk, x, reqs.get("y")
        seen["removed"] = admin.remove_by_regex(f".*{re.escape(chunk_hash_hex(chunk))}.*", True)

    def pool_copy() -> str:
        chunk = seen["chunk"]
        key = meta.layer_key(chunk, 0) if mode == "layerwise" else meta.pool_key(chunk)
        data = bytes(admin.get(key))
        if not data:
            return "absent"
        got = torch.frombuffer(bytearray(data), dtype=torch.float16)
        return classify_copy(got, expected_values(hashes, layers))

    try:
        saver.add("a", prompt, 1)
        step, deadline = 0, time.monotonic() + DEADLINE_S
        while saver.live() and time.monotonic() < deadline:
            _run(saver, step, counters, failures)
            step += 1
            time.sleep(0.01)
        assert not saver.live(), "the saving request never finished"

        inst.add("x", prompt, 1)
        inst.add("y", prompt + [base + 1000 + i for i in range(20)], 1)  # shares x's 3 chunks, computes its own
        _run(inst, step, counters, failures, evict)
        step += 1
        x, y = seen.get("x"), seen.get("y")
        assert x is not None and seen["removed"] > 0, "control: x's synchronous load did not meet the eviction"
        block = x.block_ids[0][EVICTED]
        assert block in inst.last_kv_out.invalid_block_ids, "control: the evicted chunk's load did not fail"
        # control: in the same step y hit x's block in vLLM's prefix cache and planned a save from it
        assert y is not None and y.can_save and y.save_start_token <= EVICTED * BLOCK
        assert y.block_ids[0][EVICTED] == block
        inst.worker._worker.drain(30)  # type: ignore[attr-defined]
        assert pool_copy() in ("absent", RIGHT)  # never the unwritten block (the sentinel)

        deadline = time.monotonic() + DEADLINE_S
        while inst.live() and time.monotonic() < deadline:  # vLLM recomputes x's block; a later step saves it
            _run(inst, step, counters, failures)
            step += 1
            time.sleep(0.01)
        assert not inst.live(), "the requests never finished"
        assert pool_copy() == RIGHT
        assert failures == [], [f.what for f in failures]
    finally:
        saver.close()
        inst.close()
        admin.close()
