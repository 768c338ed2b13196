"""Helpers the ascend-dist packages' tests share (the dev-only ``ascend-dist-testing`` distribution).

- `ports`: free loopback ports and waiting until one accepts;
- `vllm_builders`: a tiny model directory, ``VllmConfig``/``KVCacheConfig`` builders, vLLM's block hasher,
  requests and a connector pair (vLLM imported inside the functions);
- `hostile`: hostile ``kv_transfer_params`` tables, a driver of vLLM's real Scheduler, a loopback metaserver;
- `engines`: the engine tier's prompts, output comparisons and pool checks;
- `pool_checks`: `LoadVerifier`, which proves a pool load wrote every destination with the right bytes.

Nothing is imported here, so ``import ascend_dist.testing`` needs neither vLLM nor torch.
"""
