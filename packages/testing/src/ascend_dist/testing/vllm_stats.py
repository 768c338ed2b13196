"""Read a connector's stats back through vLLM's own objects: the periodic log line and Prometheus.

`read_back` hands a payload (what the scheduler puts in ``SchedulerStats.kv_connector_stats``) to
vLLM's `KVConnectorLogging` (the "KV Transfer metrics" line) and to `KVConnectorProm` with a fresh
`CollectorRegistry` of its own, so tests neither share nor pollute the process-wide registry.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # prometheus_client comes with vLLM: imported where used, like vLLM itself
    from prometheus_client import CollectorRegistry

__all__ = ["LABELNAMES", "Readback", "read_back"]

LABELNAMES = ["model_name", "engine"]
_LABELVALUES: dict[int, list[object]] = {0: ["tiny", "0"]}


def _registry() -> CollectorRegistry:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry()


@dataclass
class Readback:
    """What vLLM made of the payloads: its log lines and a registry with our metrics."""

    lines: list[str] = field(default_factory=list)
    registry: CollectorRegistry = field(default_factory=_registry)

    def sample(self, name: str, **labels: str) -> float | None:
        """One sample's value (None: never observed), with the engine labels filled in."""
        return self.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0", **labels})


def read_back(vllm_config: Any, *payloads: dict[str, Any] | None) -> Readback:
    """Feed ``payloads`` (None ones skipped, as vLLM skips them) to vLLM's logging and Prometheus objects."""
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm

    out = Readback()

    class _Prom(KVConnectorProm):
        _gauge_cls = functools.partial(Gauge, registry=out.registry)  # type: ignore[assignment]
        _counter_cls = functools.partial(Counter, registry=out.registry)  # type: ignore[assignment]
        _histogram_cls = functools.partial(Histogram, registry=out.registry)  # type: ignore[assignment]

    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    prom = _Prom(vllm_config, LABELNAMES, _LABELVALUES)
    for payload in payloads:
        if payload is None:
            continue
        logging.observe(payload)
        prom.observe(payload, 0)
    logging.log(log_fn=lambda fmt, *args: out.lines.append(fmt % args))
    return out
