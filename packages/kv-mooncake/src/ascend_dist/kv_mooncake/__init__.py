"""ascend_dist.kv_mooncake: not implemented yet; see this package's README for what it will hold."""

__all__: list[str] = []
