"""ascend_dist.kv_offload: KV-cache offload to host memory (native, simple, recompute, UCM, sparse).

Importing this package imports nothing heavy; use the modules (see the package README):
``transfer`` / ``offload_worker`` (the transfer worker), ``recompute_*`` and ``messages`` (the
recompute-on-preemption connector), ``simple_worker``, ``ucm``, ``sparse_plan`` / ``sparse_lru``,
and the vLLM adapters ``vllm_native``, ``vllm_simple``, ``vllm_recompute``, ``vllm_ucm``.
"""

__all__: list[str] = []
