"""Stable module path for ``MooncakeLayerwiseConnector`` (implemented in `ascend_dist.kv_mooncake.push`)."""

from ascend_dist.kv_mooncake.push.vllm_connector import MooncakeLayerwiseConnector, MooncakeLayerwiseMetadata

__all__ = ["MooncakeLayerwiseConnector", "MooncakeLayerwiseMetadata"]
