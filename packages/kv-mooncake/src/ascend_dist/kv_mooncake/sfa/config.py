"""Configuration of ``SfaRemoteD2HConnector``, parsed from vLLM's ``kv_transfer_config`` fields.

Runs in: scheduler and worker processes of both roles. Pure: no I/O. Every bad value raises
`ConfigError` naming the field and the values it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.config import (
    MAX_MESSAGE_BYTES,
    WHOLE_EXTRA,
    ConnectorConfig,
    Role,
    bool_field,
    ints,
    option,
    seconds,
    text,
)

__all__ = ["BACKENDS", "SfaConfig"]

BACKENDS = ("memfabric", "mooncake")
"""Remote-read engines: MemFabric (Ascend, upstream's only choice) or Mooncake (any machine)."""


@dataclass(frozen=True)
class SfaConfig(ConnectorConfig):
    """Everything the SFA remote-D2H connector reads from the ``kv_transfer_config``.

    The shared fields are `ConnectorConfig`'s; the ones listed here are specific or say more.
    Built by `ConnectorConfig.from_kv_transfer_config`; the extra-config keys are the names of
    the attributes below, each optional with the default it shows.

    Attributes:
        kv_port: Base of the side channel: D rank r of global DP rank g binds
            ``kv_port + g * decode.tp_size + r``.
        prefill: P's topology (``tp_size`` must be a multiple of ``decode.tp_size``).
        dp_rank: This instance's GLOBAL data-parallel rank, at most 65535.
        max_message_bytes: Largest side-channel message accepted (at most 64 MiB).
        host: Interface D binds and advertises (never a wildcard).
        transfer_backend: ``memfabric`` (Ascend driver needed) or ``mooncake``.
        use_layerwise: D reads each layer as soon as P wrote it (the only mode implemented).
        hello_timeout_s: How long P waits for D to accept its metadata (upstream: 10 s).
        read_timeout_s: How long P waits for D's answer to one layer's read request; P's reuse
            gate opens after it at the latest (D refuses to start a read P gave up on).
        recv_timeout_s: How long D waits for a request's last layer before reporting its blocks
            failed (upstream has no deadline: a dead P parks the request forever).
        dest_wait_s: How long D's read thread waits for a request's destination blocks to arrive
            from its own scheduler when P is faster than D's next step.
        quarantine_s: After a failed read, how long D holds the request's blocks before reporting
            it finished (a late engine write must not land in reused blocks, Mooncake #4247).
        read_retries: How often D repeats a failed engine read before failing the batch (Mooncake
            #4209: the first TCP transfer after an idle gap may fail once).
        endpoint_retry_s: After a D endpoint missed a deadline, P fails new reads to it at once for
            this long instead of stalling every layer (then it sends a fresh hello).
        extra: The whole ``kv_connector_extra_config`` as given (kept for inspection).
    """

    # Redeclared with tighter bounds than the base's (they keep their place in the field order).
    dp_rank: int = option(0, ints(0, 65535))
    max_message_bytes: int = option(4 * 1024 * 1024, ints(1024, MAX_MESSAGE_BYTES))
    transfer_backend: str = option("memfabric", text)
    use_layerwise: bool = option(True, bool_field, label="kv_connector_extra_config.use_layerwise")
    hello_timeout_s: float = option(10.0, seconds())
    read_timeout_s: float = option(60.0, seconds())
    recv_timeout_s: float = option(300.0, seconds())
    dest_wait_s: float = option(2.0, seconds(allow_zero=True))
    quarantine_s: float = option(1.0, seconds(allow_zero=True))
    endpoint_retry_s: float = option(5.0, seconds(allow_zero=True))
    read_retries: int = option(1, ints(0, 3))
    extra: dict[str, Any] = field(default_factory=dict, metadata=WHOLE_EXTRA)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transfer_backend not in BACKENDS:
            raise ConfigError(
                "kv_connector_extra_config.transfer_backend", self.transfer_backend, " or ".join(BACKENDS)
            )
        if not self.use_layerwise:
            raise ConfigError("kv_connector_extra_config.use_layerwise", False, "true (whole-request reads: not built)")
        p_tp, d_tp = self.prefill.tp_size, self.decode.tp_size
        if p_tp < d_tp or p_tp % d_tp:
            raise ConfigError("prefill.tp_size", p_tp, f"a multiple of decode.tp_size={d_tp} (P_tp >= D_tp)")
        for name, topo in (("prefill", self.prefill), ("decode", self.decode)):
            if topo.pp_size != 1 or topo.pcp_size != 1 or topo.dcp_size != 1:
                raise ConfigError(f"{name}.pp_size/pcp_size/dcp_size", (topo.pp_size, topo.pcp_size), "1")
        if self.dp_rank >= self.decode.dp_size and self.role is Role.CONSUMER:
            raise ConfigError("dp_rank", self.dp_rank, f"an int in [0, decode.dp_size={self.decode.dp_size})")
        top = self.kv_port + self.decode.dp_size * d_tp - 1
        if top > 65535:
            raise ConfigError("kv_port", self.kv_port, f"a base whose highest D port ({top}) is <= 65535")

    @property
    def tp_ratio(self) -> int:
        """``P_tp // D_tp``: P ranks feeding one D rank."""
        return self.prefill.tp_size // self.decode.tp_size

    @property
    def d_base_port(self) -> int:
        """D's side-channel base for this instance's global DP rank."""
        return self.kv_port + self.dp_rank * self.decode.tp_size
