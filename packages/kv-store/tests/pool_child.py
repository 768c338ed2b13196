"""Child process of the two-process Mooncake test: one pool instance that saves a prompt and stays up.

Usage: python pool_child.py <master host:port> <seed> <prompt_len>
Prints ``READY <sha256 of each saved block, comma-separated>`` once its saves completed, then
waits for a line on stdin (its Mooncake segment holds the objects, so it must outlive the reader).
"""

from __future__ import annotations

import hashlib
import sys

import torch

from ascend_dist.kv_store import NewRequest, PoolConfig, PoolSpec, StepInput, build_scheduler, build_worker
from ascend_dist.kv_store.backends.mooncake import MooncakeBackend
from ascend_dist.kv_store.config.config import MooncakeStoreConfig

SPEC = PoolSpec(model="tiny", block_sizes=(16,), num_kv_heads=2)


def main() -> None:
    master, seed, prompt_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cfg = MooncakeStoreConfig.load(
        {
            "master_server_address": master,
            "protocol": "tcp",
            "global_segment_size": "64MB",
            "local_buffer_size": "16MB",
        },
        env={},
    )
    backend = MooncakeBackend(cfg)
    pool_cfg = PoolConfig.from_extra({})
    worker = build_worker(SPEC, pool_cfg, backend)
    gen = torch.Generator().manual_seed(seed)
    caches = {
        f"model.layers.{i}.self_attn.attn": tuple(
            torch.randn(16, 16, 2, 8, generator=gen).to(torch.float16) for _ in range(2)
        )
        for i in range(2)
    }
    worker.register_kv_caches(caches, 16)
    scheduler = build_scheduler(SPEC, pool_cfg, worker.safe_lookup)
    prompt = list(range(1000, 1000 + prompt_len))
    blocks = list(range(1, prompt_len // 16 + 2))
    scheduler.get_num_new_matched_tokens("child", prompt, prompt_len, 0)
    meta = scheduler.build_meta(StepInput(new=[NewRequest("child", prompt, [blocks], 0, prompt_len)]))
    worker.wait_for_save(meta)
    worker.drain(20)
    digests = [
        hashlib.sha256(b"".join(t[b].numpy().tobytes() for kv in caches.values() for t in kv)).hexdigest()
        for b in blocks[: prompt_len // 16]
    ]
    print("READY " + ",".join(digests), flush=True)
    sys.stdin.readline()
    worker.close()


if __name__ == "__main__":
    main()
