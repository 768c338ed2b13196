"""vLLM's own connector stats beside ours, for our subclasses of vLLM connectors that report stats.

Runs in: vLLM's worker processes, its scheduler and its front end, like `vllm_stats`. An adapter
module: only connector adapters import it (it imports vLLM).

Some of our connectors subclass a vLLM connector that already reports stats of its own (the native
offloading connector: ``vllm:kv_offload_*``; the simple one: ``vllm:simple_kv_offload_*``) and add
what vLLM has no metric for (failures by kind, the simple connector's bytes) through our recorder
(`ascend_dist.common.transfer_stats.TransferStats`). vLLM keeps one stats object per connector, so
both travel as one `PairedStats` payload: ``{"vllm": vLLM's payload or None, "ascend": ours or
None}`` with a schema marker, and `PairedPromMetrics` hands each half to its own metrics (vLLM's
class for theirs, `AscendPromMetrics` for ours). vLLM's half is never reinterpreted: its names,
labels and log keys stay exactly vLLM's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ascend_dist.common.errors import ProtocolError
from ascend_dist.common.transfer_stats import Channel, TransferStats, from_builtins, to_builtins
from ascend_dist.common.vllm_stats import AscendPromMetrics, AscendTransferStats, TransferStatsReporting

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["PairedPromMetrics", "PairedStats", "PairedStatsReporting", "is_paired_payload", "paired_reporter"]

logger = logging.getLogger(__name__)

PAIRED_KEY = "ascend_dist_paired_stats"
PAIRED_VERSION = 1

# Connector class name -> class, for each class using the mixin (filled as they are defined): a
# multi-connector keys its children's payloads by class name, which vLLM's factory may not know.
_REPORTERS: dict[str, type[PairedStatsReporting]] = {}


def is_paired_payload(value: object) -> bool:
    """Whether ``value`` is the builtins form of a `PairedStats`."""
    return isinstance(value, dict) and value.get(PAIRED_KEY) == PAIRED_VERSION


def paired_reporter(name: str) -> type[PairedStatsReporting] | None:
    """The connector class of that name using `PairedStatsReporting`, if one was defined in this process."""
    return _REPORTERS.get(name)


def _check(value: object) -> dict[str, Any]:
    """The payload, validated: the marker, vLLM's half a dict or None, ours a valid snapshot or None.

    Raises:
        ProtocolError: naming the field that is wrong.
    """
    if not is_paired_payload(value):
        raise ProtocolError(f"connector stats: {PAIRED_KEY} is not {PAIRED_VERSION}")
    assert isinstance(value, dict)
    theirs, ours = value.get("vllm"), value.get("ascend")
    if theirs is not None and not isinstance(theirs, dict):
        raise ProtocolError(f"connector stats: vllm is {type(theirs).__name__}, not a dict")
    if ours is not None:
        from_builtins(ours)  # raises ProtocolError naming its field
    return value


@dataclass
class PairedStats(KVConnectorStats):
    """One connector's stats: vLLM's (``data["vllm"]``, its own class's payload) and ours (``data["ascend"]``).

    A subclass names vLLM's stats class (``vllm_stats_cls``); the halves are rebuilt from ``data``
    on each use, so ``data`` is the whole state and travels between processes as vLLM's own do.
    """

    vllm_stats_cls: ClassVar[type[KVConnectorStats]]

    def __post_init__(self) -> None:
        if not is_paired_payload(self.data):
            self.reset()

    @classmethod
    def of(cls, theirs: KVConnectorStats | None, ours: TransferStats | None) -> PairedStats:
        """The pair from vLLM's stats object and what our recorder holds (taken: it starts afresh)."""
        snapshot = ours.take() if ours is not None else None
        return cls(data=cls._payload(theirs, to_builtins(snapshot) if snapshot is not None else None))

    @staticmethod
    def _payload(theirs: KVConnectorStats | None, ours: dict[str, Any] | None) -> dict[str, Any]:
        keep = theirs is not None and not theirs.is_empty()
        return {PAIRED_KEY: PAIRED_VERSION, "vllm": theirs.data if keep else None, "ascend": ours}  # type: ignore[union-attr]

    def theirs(self) -> KVConnectorStats | None:
        """The vLLM half as vLLM's own stats object (None: nothing of theirs)."""
        raw = self.data.get("vllm")
        return None if raw is None else self.vllm_stats_cls(data=raw)

    def ours(self) -> AscendTransferStats | None:
        """Our half (None: nothing of ours)."""
        raw = self.data.get("ascend")
        return None if raw is None else AscendTransferStats(data=raw)

    def reset(self) -> None:
        """Forget both halves."""
        self.data = self._payload(None, None)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Each half aggregated with the other's by its own class (vLLM's by vLLM's rules).

        Raises:
            TypeError: ``other`` is not a `PairedStats` (vLLM aggregates one connector's stats only).
        """
        if not isinstance(other, PairedStats):
            raise TypeError(f"{type(self).__name__} cannot aggregate {type(other).__name__}")
        if other.is_empty():
            return self
        theirs, other_theirs = self.theirs(), other.theirs()
        if other_theirs is not None:
            theirs = other_theirs if theirs is None else theirs.aggregate(other_theirs)
        ours, other_ours = self.ours(), other.ours()
        if other_ours is not None:
            ours = other_ours if ours is None else ours.aggregate(other_ours)  # type: ignore[assignment]
        self.data = self._payload(theirs, None if ours is None or ours.is_empty() else ours.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        """The numbers for vLLM's "KV Transfer metrics" line: vLLM's, then ours."""
        out: dict[str, int | float] = {}
        for half in (self.theirs(), self.ours()):
            if half is not None and not half.is_empty():
                out.update(half.reduce())
        return out

    def is_empty(self) -> bool:
        """Neither half holds anything."""
        return all(half is None or half.is_empty() for half in (self.theirs(), self.ours()))


class PairedPromMetrics(KVConnectorPromMetrics):
    """vLLM's connector metrics and ours side by side; a payload's halves go to each."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        *,
        theirs: KVConnectorPromMetrics | None,
        ours: AscendPromMetrics,
    ) -> None:
        """Wrap vLLM's metrics object (None: vLLM registers none) and ours (maybe shared by a multi-connector)."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[arg-type]
        self.theirs = theirs
        self.ours = ours

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record each half with its own metrics; a malformed payload is logged and dropped."""
        try:
            data = _check(transfer_stats_data)
        except ProtocolError as exc:
            logger.error("dropped a malformed paired stats payload: %s", exc)
            return
        if data.get("vllm") is not None and self.theirs is not None:
            self.theirs.observe(data["vllm"], engine_idx)
        if data.get("ascend") is not None:
            self.ours.observe(data["ascend"], engine_idx)


class PairedStatsReporting:
    """Mixin for our subclass of a vLLM connector with stats (before vLLM's class in the bases).

    The class names its `PairedStats` subclass (``paired_stats_cls``) and our channels
    (``stats_channels``); an instance records ours into ``self.transfer_stats`` and vLLM's
    connector keeps reporting its own, next in the MRO.
    """

    stats_channels: ClassVar[tuple[Channel, ...]] = ()
    paired_stats_cls: ClassVar[type[PairedStats]]
    transfer_stats = TransferStatsReporting.transfer_stats

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Remember the class by name (see `paired_reporter`)."""
        super().__init_subclass__(**kwargs)
        _REPORTERS[cls.__name__] = cls

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The vLLM connector's stats of this step and ours since the last poll (None: neither has any)."""
        theirs = super().get_kv_connector_stats()  # type: ignore[misc]
        stats = self.paired_stats_cls.of(theirs, self.transfer_stats)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """Rebuild the pair; a malformed payload is logged and counted as empty."""
        if data is None:
            return cls.paired_stats_cls()
        try:
            _check(data)
        except ProtocolError as exc:
            logger.error("%s: dropped a malformed stats payload: %s", cls.__name__, exc)
            return cls.paired_stats_cls()
        return cls.paired_stats_cls(data=data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        shared: AscendPromMetrics | None = None,
    ) -> KVConnectorPromMetrics:
        """The vLLM connector's metrics beside ours (``shared``: a multi-connector's one registration)."""
        theirs = super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)  # type: ignore[misc]
        ours = shared or AscendPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, cls.stats_channels
        )
        return PairedPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, theirs=theirs, ours=ours
        )
