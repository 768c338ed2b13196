"""Our connectors' transfer stats in vLLM's terms: one `KVConnectorStats` and one `KVConnectorPromMetrics`.

Runs in: vLLM's worker processes (`get_kv_connector_stats`), its scheduler (aggregation across
workers, scheduler-side pool lookups) and its front end (the periodic "KV Transfer metrics" log line
and the Prometheus metrics). An adapter module: only connector adapters import it (it imports vLLM).

Every connector of this repository mixes `TransferStatsReporting` into its vLLM class and owns a
`ascend_dist.common.transfer_stats.TransferStats` recorder; the stats payload is that recorder's
snapshot in builtins form, so vLLM ships plain lists and ints between processes.

Prometheus names: the ``p2p`` channel uses vLLM's Mooncake connector names and labels
(``vllm:mooncake_xfer_time_seconds``, ``vllm:mooncake_bytes_transferred``,
``vllm:mooncake_num_descriptors``) and ``vllm:mooncake_num_failed_transfers`` with an extra ``kind``;
the pool and offload channels have their own (``vllm:ascend_pool_*``, ``vllm:ascend_offload_*``)
with an extra ``direction`` (``load`` into the device cache, ``save`` out of it), plus the pool's
``vllm:ascend_pool_hit_tokens`` / ``vllm:ascend_pool_miss_tokens`` counters.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ascend_dist.common.errors import ProtocolError
from ascend_dist.common.transfer_stats import (
    Channel,
    StatsData,
    TransferStats,
    from_builtins,
    merge,
    summarize,
    to_builtins,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["AscendPromMetrics", "AscendTransferStats", "TransferStatsReporting"]

logger = logging.getLogger(__name__)

# Bucket edges: vLLM's Mooncake connector's (5 ms to 5 s; 2 KiB to 8 GiB; 10 to 50k descriptors).
XFER_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))
DESCRIPTOR_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)

# channel -> (metric name prefix, whether its metrics carry a ``direction`` label)
_FAMILIES: dict[Channel, tuple[str, bool]] = {
    "p2p": ("vllm:mooncake", False),  # vLLM's names and labels
    "pool": ("vllm:ascend_pool", True),
    "offload": ("vllm:ascend_offload", True),
}


@dataclass
class AscendTransferStats(KVConnectorStats):
    """VLLM's stats container over a `StatsData` snapshot in builtins form (``data``)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def snapshot(self) -> StatsData:
        """The payload as a `StatsData` (validated)."""
        return from_builtins(self.data)

    def reset(self) -> None:
        """Forget everything."""
        self.data = to_builtins(StatsData())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add another worker's (or step's) stats to these."""
        if not other.is_empty():
            self.data = to_builtins(merge(self.snapshot(), from_builtins(other.data)))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval's numbers for vLLM's "KV Transfer metrics" log line."""
        return summarize(self.snapshot())

    def is_empty(self) -> bool:
        """Nothing recorded in this interval."""
        return self.snapshot().is_empty()


class AscendPromMetrics(KVConnectorPromMetrics):
    """The Prometheus metrics of the given channels, registered once per process."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        channels: tuple[Channel, ...],
    ) -> None:
        """Register each channel's histograms and failure counter (and the pool's token counters)."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[arg-type]
        self.channels = tuple(dict.fromkeys(channels))
        self._families: dict[tuple[Channel, str], Any] = {}
        histogram: Any = self._histogram_cls  # vLLM's Histogram (or a test's, bound to its own registry)
        counter: Any = self._counter_cls
        for channel in self.channels:
            prefix, directional = _FAMILIES[channel]
            extra = ["direction"] if directional else []
            for name, doc, buckets in (
                ("xfer_time_seconds", "Histogram of transfer duration", XFER_TIME_BUCKETS),
                ("bytes_transferred", "Histogram of bytes transferred per transfer", BYTES_BUCKETS),
                ("num_descriptors", "Histogram of number of descriptors per transfer", DESCRIPTOR_BUCKETS),
            ):
                self._families[channel, name] = histogram(
                    name=f"{prefix}_{name}",
                    documentation=f"{doc} ({channel} KV cache transfers of ascend-dist connectors).",
                    buckets=buckets,
                    labelnames=[*labelnames, *extra],
                )
            self._families[channel, "failed"] = counter(
                name=f"{prefix}_num_failed_transfers",
                documentation=f"Number of failed {channel} KV cache transfers of ascend-dist connectors, by kind.",
                labelnames=[*labelnames, *extra, "kind"],
            )
        if "pool" in self.channels:
            for key in ("hit", "miss"):
                self._families["pool", key] = counter(
                    name=f"vllm:ascend_pool_{key}_tokens",
                    documentation=f"Prompt tokens the KV pool lookup {'found' if key == 'hit' else 'did not find'}.",
                    labelnames=labelnames,
                )

    def _child(self, channel: Channel, name: str, engine_idx: int, *extra: str) -> Any:
        return self._families[channel, name].labels(*self.per_engine_labelvalues[engine_idx], *extra)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one payload; rows of channels this instance did not register are a bug and raise."""
        data = from_builtins(transfer_stats_data)
        for t in data.transfers:
            extra = (t.direction,) if _FAMILIES[t.channel][1] else ()
            self._child(t.channel, "xfer_time_seconds", engine_idx, *extra).observe(t.duration_s)
            self._child(t.channel, "bytes_transferred", engine_idx, *extra).observe(t.nbytes)
            self._child(t.channel, "num_descriptors", engine_idx, *extra).observe(t.descriptors)
        for f in data.failures:
            extra = (f.direction,) if _FAMILIES[f.channel][1] else ()
            if f.count:
                self._child(f.channel, "failed", engine_idx, *extra, f.kind.value).inc(f.count)
        if data.pool_hit_tokens:
            self._child("pool", "hit", engine_idx).inc(data.pool_hit_tokens)
        if data.pool_miss_tokens:
            self._child("pool", "miss", engine_idx).inc(data.pool_miss_tokens)


class TransferStatsReporting:
    """Mixin for a connector's vLLM class (before vLLM's base in the bases): vLLM's three stats hooks.

    The class says which channels it records (``stats_channels``); an instance records into
    ``self.transfer_stats`` (one per connector instance, created here lazily).
    """

    stats_channels: ClassVar[tuple[Channel, ...]] = ()

    @property
    def transfer_stats(self) -> TransferStats:
        """This connector's recorder (its first channel labels its records)."""
        rec = self.__dict__.get("_ascend_transfer_stats")
        if rec is None:
            rec = self.__dict__.setdefault("_ascend_transfer_stats", TransferStats(self.stats_channels[0]))
        return rec

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this connector recorded since vLLM's last poll (None: nothing)."""
        data = self.transfer_stats.take()
        return AscendTransferStats(data=to_builtins(data)) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuild the stats object from its payload; a malformed payload is logged and counted as empty."""
        if data is None:
            return AscendTransferStats()
        try:
            from_builtins(data)
        except ProtocolError as exc:
            logger.error("%s: dropped a malformed stats payload: %s", cls.__name__, exc)
            return AscendTransferStats()
        return AscendTransferStats(data=data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """Register this connector's channels' metrics."""
        return AscendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, cls.stats_channels)
