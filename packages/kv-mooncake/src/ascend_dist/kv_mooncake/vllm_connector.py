"""Stable module path for ``MooncakeConnectorV1`` / ``MooncakeHybridConnector`` (implemented in `pull`).

Deployment configs name this path in ``kv_connector_module_path``; it stays a re-export.
"""

from ascend_dist.kv_mooncake.pull.vllm_connector import (
    MooncakeConnectorV1,
    MooncakeConnectorV1Metadata,
    MooncakeHybridConnector,
)

__all__ = ["MooncakeConnectorV1", "MooncakeConnectorV1Metadata", "MooncakeHybridConnector"]
