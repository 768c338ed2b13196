"""ascend_dist.hccl_ctypes: not implemented yet; see this package's README for what it will hold."""

__all__: list[str] = []
