"""The multi-connector's stats: its children's, as vLLM's MultiConnector reports them, with our pair shared.

Runs in: vLLM's scheduler and front-end processes (an adapter module: it imports vLLM). vLLM's
MultiConnector keys each child's stats by the child's class name and builds each child class's
Prometheus metrics separately. Two of our children would then register the same metric names twice
(a duplicate-timeseries error) and vLLM would look their payloads up by class name in its factory
(where ours are registered under vllm-ascend's names). Here our children share one
`AscendPromMetrics` over the union of their channels, and a payload of ours is recognised by its
schema marker; other children are handled exactly as vLLM does. Our subclasses of vLLM connectors
that report vLLM's stats beside ours (`PairedStatsReporting`: the native and simple offload
connectors) register vLLM's metrics of their own and share that one `AscendPromMetrics` for ours
(the recompute connector's ``vllm:ascend_offload_*`` names are theirs too); their payloads are
rebuilt by the class of that name (`paired_reporter`), which vLLM's factory may not know.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorPromMetrics,
    MultiKVConnectorStats,
)

from ascend_dist.common.transfer_stats import Channel, is_stats_payload
from ascend_dist.common.vllm_paired_stats import PairedStatsReporting, is_paired_payload, paired_reporter
from ascend_dist.common.vllm_stats import AscendPromMetrics, TransferStatsReporting

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig

__all__ = ["children_prom_metrics", "children_stats"]


def children_stats(data: dict[str, Any] | None) -> MultiKVConnectorStats:
    """Rebuild the children's stats from vLLM's ``{child class name: payload}``."""
    if data is None:
        return MultiKVConnectorStats()
    rebuilt: dict[str, KVConnectorStats] = {}
    for name, value in data.items():
        if isinstance(value, KVConnectorStats):
            rebuilt[name] = value
        elif is_stats_payload(value):
            stats = TransferStatsReporting.build_kv_connector_stats(value)
            assert stats is not None
            rebuilt[name] = stats
        elif is_paired_payload(value) and (reporter := paired_reporter(name)) is not None:
            stats = reporter.build_kv_connector_stats(value)  # vLLM's factory may not know the class by name
            assert stats is not None
            rebuilt[name] = stats
        else:
            stats = KVConnectorFactory.get_connector_class_by_name(name).build_kv_connector_stats(value)
            if stats is not None:
                rebuilt[name] = stats
    return MultiKVConnectorStats(data=rebuilt)


def children_prom_metrics(
    children: Iterable[tuple[type, VllmConfig]],
    vllm_config: VllmConfig,
    metric_types: Any,
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> KVConnectorPromMetrics:
    """One metrics object per child class name; ours all point at one shared `AscendPromMetrics`."""
    ours: list[type] = []
    paired: list[tuple[type, VllmConfig]] = []
    metrics: dict[str, KVConnectorPromMetrics] = {}
    for cls, child_config in children:
        if cls.__name__ in metrics or cls in ours or any(cls is c for c, _ in paired):
            continue
        if issubclass(cls, TransferStatsReporting):
            ours.append(cls)
            continue
        if issubclass(cls, PairedStatsReporting):
            paired.append((cls, child_config))
            continue
        prom = cls.build_prom_metrics(child_config, metric_types, labelnames, per_engine_labelvalues)
        if prom is not None:
            metrics[cls.__name__] = prom
    if ours or paired:
        classes = [*ours, *(cls for cls, _ in paired)]
        channels: list[Channel] = [c for cls in classes for c in cls.stats_channels]  # type: ignore[attr-defined]
        shared = AscendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, tuple(channels))
        metrics.update({cls.__name__: shared for cls in ours})
        for cls, child_config in paired:
            metrics[cls.__name__] = cls.build_prom_metrics(  # type: ignore[attr-defined]
                child_config, metric_types, labelnames, per_engine_labelvalues, shared=shared
            )
    return MultiKVConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, metrics)
