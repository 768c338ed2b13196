"""The module paths deployment configs name in ``kv_connector_module_path`` keep resolving (vLLM 0.33).

The connectors moved into `pull`, `push` and `sfa`; vLLM's own factory, given the old paths, must
return the very classes the plugin registers under the new ones.
"""

from __future__ import annotations

import importlib

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402

PATHS = [
    ("MooncakeConnectorV1", "ascend_dist.kv_mooncake.vllm_connector", "ascend_dist.kv_mooncake.pull.vllm_connector"),
    (
        "MooncakeHybridConnector",
        "ascend_dist.kv_mooncake.vllm_connector",
        "ascend_dist.kv_mooncake.pull.vllm_connector",
    ),
    (
        "MooncakeLayerwiseConnector",
        "ascend_dist.kv_mooncake.layerwise.vllm_connector",
        "ascend_dist.kv_mooncake.push.vllm_connector",
    ),
    (
        "SfaRemoteD2HConnector",
        "ascend_dist.kv_mooncake.sfa.vllm_connector",
        "ascend_dist.kv_mooncake.sfa.vllm_connector",
    ),
]


@pytest.mark.parametrize(("name", "stable", "home"), PATHS)
def test_factory_resolves_the_stable_path_to_the_implementation(name: str, stable: str, home: str) -> None:
    config = KVTransferConfig(kv_connector=name, kv_connector_module_path=stable, kv_role="kv_both")
    resolved = KVConnectorFactory.get_connector_class(config)
    assert resolved is getattr(importlib.import_module(home), name)
    assert resolved.__module__ == home


def test_a_wrong_path_is_refused_by_the_factory() -> None:
    # The control: the factory does read the path (a name the module lacks fails).
    config = KVTransferConfig(
        kv_connector="MooncakeLayerwiseConnector",
        kv_connector_module_path="ascend_dist.kv_mooncake.vllm_connector",
        kv_role="kv_both",
    )
    with pytest.raises(AttributeError, match="MooncakeLayerwiseConnector"):
        KVConnectorFactory.get_connector_class(config)
