"""Former home of the layer-wise push connector, now `ascend_dist.kv_mooncake.push`.

Only `layerwise.vllm_connector` is kept, so ``kv_connector_module_path`` values keep working.
"""

__all__: list[str] = []
