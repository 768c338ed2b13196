"""Settings: the pool config (``kv_connector_extra_config``), backend client settings and derived sizes.

Modules by role: `config` (`PoolConfig`, the extra-config keys), `store_config` (``mooncake.json`` /
``MOONCAKE_*`` and the openYuanrong JSON), `sizes` (block sizes, transfer granularity, PP layer
partitions), `layerwise_options` (the layer-wise transfer settings). The bottom layer: imports only
`ascend_dist.common` and the standard library, never another kv-store package (enforced by
``tests/test_layering.py``).
"""

__all__: list[str] = []
