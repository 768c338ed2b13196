"""The ``kv_connector_extra_config`` keys vllm-ascend's Mooncake deployment guides write, through our parser.

The guides (single- and multi-node P/D with ``MooncakeConnectorV1`` and ``MooncakeLayerwiseConnector``)
put ``prefill`` / ``decode`` with ``dp_size`` and ``tp_size``, and ``use_ascend_direct: true``, in the
extra config, with ``kv_port`` and ``engine_id`` as strings. Each is accepted with its meaning here,
or refused with a `ConfigError` that names the key and what to write instead. (The top-level keys
vLLM itself refuses, ``kv_parallel_size`` and ``kv_rank``, never reach us: see the README's operator
section.)
"""

from __future__ import annotations

from typing import Any

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.config import ConnectorConfig
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig

GUIDE_EXTRA: dict[str, Any] = {
    "use_ascend_direct": True,
    "prefill": {"dp_size": 2, "tp_size": 8},
    "decode": {"dp_size": 32, "tp_size": 1},
}


def _parse(extra: dict[str, Any], cls: type[ConnectorConfig] = PullConfig) -> ConnectorConfig:
    return cls.from_kv_transfer_config(engine_id="0", kv_role="kv_producer", kv_port="36000", extra=extra)


@pytest.mark.parametrize("cls", [PullConfig, LayerwiseConfig])
def test_the_guides_extra_config_is_accepted_with_its_meaning(cls: type[ConnectorConfig]) -> None:
    config = _parse(GUIDE_EXTRA, cls)
    assert (config.prefill.dp_size, config.prefill.tp_size) == (2, 8)
    assert (config.decode.dp_size, config.decode.tp_size) == (32, 1)
    assert config.kv_port == 36000  # a string in the guides
    assert config.protocol == "ascend"  # use_ascend_direct: Mooncake's Ascend transport


def test_without_use_ascend_direct_the_protocol_is_mooncake_protocol_or_tcp() -> None:
    topology = {k: GUIDE_EXTRA[k] for k in ("prefill", "decode")}
    assert _parse(topology).protocol == "tcp"
    assert _parse({**topology, "mooncake_protocol": "rdma"}).protocol == "rdma"
    assert _parse({**GUIDE_EXTRA, "mooncake_protocol": "ascend"}).protocol == "ascend"  # agrees: fine


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({**GUIDE_EXTRA, "use_ascend_direct": False}, "mooncake_protocol"),  # names the replacement
        ({**GUIDE_EXTRA, "use_ascend_direct": "true"}, "true or false"),  # no truthy strings
        ({**GUIDE_EXTRA, "mooncake_protocol": "tcp"}, "left out"),  # contradiction: refused, not guessed
    ],
)
def test_use_ascend_direct_refusals_name_the_key_and_the_fix(extra: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        _parse(extra)
    assert info.value.field == "kv_connector_extra_config.use_ascend_direct"
    assert says in str(info.value)


def test_a_missing_topology_names_the_key_the_guides_write() -> None:
    with pytest.raises(ConfigError) as info:
        _parse({"use_ascend_direct": True, "prefill": {"dp_size": 2, "tp_size": 8}})
    assert info.value.field == "kv_connector_extra_config.decode"
