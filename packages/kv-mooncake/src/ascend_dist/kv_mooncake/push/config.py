"""Configuration of the layer-wise push connector, parsed from vLLM's ``kv_transfer_config`` fields.

Runs in: scheduler and worker processes. Pure: no I/O. Every bad value raises `ConfigError`
naming the field and the values it accepts. P's and D's topologies use the pull connector's
`ascend_dist.kv_mooncake.core.config.Topology` (``prefill`` / ``decode`` keys, both required on both
roles); PP is not supported by the push (no PP term in its port layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.config import (
    ConnectorConfig,
    ints,
    option,
    option_metadata,
    seconds,
)
from ascend_dist.kv_mooncake.core.mappings import ParallelInfo, pd_head_ratio
from ascend_dist.kv_mooncake.core.metaserver import TlsConfig  # re-exported: the `tls_config` key is push's
from ascend_dist.kv_mooncake.core.ports import PortLayout, PortScheme, RankCoord

__all__ = ["LayerwiseConfig", "TlsConfig"]


@dataclass(frozen=True)
class LayerwiseConfig(ConnectorConfig):
    """Everything the layer-wise connector reads from the ``kv_transfer_config``.

    The shared fields are `ConnectorConfig`'s; the ones listed here are specific or say more.
    Built by `ConnectorConfig.from_kv_transfer_config`; the extra-config keys are the names of
    the attributes below (``tls_config`` for ``tls``), each optional with the default it shows.

    Attributes:
        kv_port: Base port: D workers bind ``kv_port + dp·pcp·tp + pcp_rank·tp + tp_rank``.
        prefill: P's topology (``pp_size`` must be 1).
        decode: D's topology (``pp_size`` must be 1).
        host: Interface D binds and advertises (never a wildcard); P's engine host.
        first_layer_timeout_s: D fails a request when no layer arrived this long after it was
            announced (P's queueing and prefill scheduling included).
        layer_timeout_s: D fails a request when its next layer does not arrive within this
            long after the previous one.
        fence_timeout_s: D's longest hold of a failed request whose P senders claimed it but have
            not ended (sent `PushDone`): vLLM recomputes into its blocks only after that.
        gate_timeout_s: P's longest wait for a layer's earlier push before its storage is reused.
        rpc_timeout_s: Deadline of one side-channel attempt.
        rpc_retries: Attempts per side-channel request.
        metaserver_timeout_s: Deadline of one metaserver POST attempt (3 attempts).
        tls: The metaserver client's TLS options.
    """

    first_layer_timeout_s: float = option(120.0, seconds())
    layer_timeout_s: float = option(30.0, seconds())
    fence_timeout_s: float = option(30.0, seconds())
    gate_timeout_s: float = option(60.0, seconds())
    rpc_timeout_s: float = option(1.0, seconds())
    rpc_retries: int = option(3, ints(1, 10))
    metaserver_timeout_s: float = option(5.0, seconds())
    tls: TlsConfig = field(
        default_factory=TlsConfig, metadata=option_metadata(lambda _name, raw: TlsConfig.parse(raw), key="tls_config")
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, topo in (("prefill", self.prefill), ("decode", self.decode)):
            if topo.pp_size != 1:
                raise ConfigError(f"{name}.pp_size", topo.pp_size, "1 (the layer-wise push has no PP)")
        if self.prefill.tp_size % self.decode.tp_size:
            raise ConfigError(
                "decode.tp_size", self.decode.tp_size, f"a divisor of prefill.tp_size={self.prefill.tp_size}"
            )
        _ = self.d_ports  # validates the D port range

    @property
    def d_ports(self) -> PortLayout:
        """D's side-channel port layout."""
        d = self.decode
        return PortLayout(
            kv_port=self.kv_port,
            tp_size=d.tp_size,
            pcp_size=d.pcp_size,
            dp_size=max(d.dp_size, self.dp_rank + 1),
            scheme=PortScheme.LAYERWISE,
        )

    def d_port(self, tp_rank: int, pcp_rank: int = 0) -> int:
        """The port a D worker binds."""
        return self.d_ports.port(RankCoord(tp_rank=tp_rank, pcp_rank=pcp_rank, dp_rank=self.dp_rank))

    def parallel_infos(self, num_heads: int, use_mla: bool) -> tuple[ParallelInfo, ParallelInfo]:
        """``(P, D)`` layouts for the block/port mappings, with P's head ratio."""
        p, d = self.prefill, self.decode
        ratio = pd_head_ratio(p.tp_size, d.tp_size, num_heads, use_mla=use_mla)
        return (
            ParallelInfo(p.tp_size, p.pcp_size, p.dcp_size, use_mla, ratio),
            ParallelInfo(d.tp_size, d.pcp_size, d.dcp_size, use_mla, 1),
        )
