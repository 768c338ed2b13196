"""Configuration of the pull connector, parsed from vLLM's ``kv_transfer_config`` fields.

Runs in: scheduler and worker processes. Pure: no I/O. Every bad value raises `ConfigError`
naming the field and the values it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.config import (
    PROTOCOLS,
    WHOLE_EXTRA,
    ConnectorConfig,
    Role,
    Topology,
    ints,
    option,
    seconds,
)

__all__ = ["PROTOCOLS", "PullConfig", "Role", "Topology"]


@dataclass(frozen=True)
class PullConfig(ConnectorConfig):
    """Everything the pull connector reads from the ``kv_transfer_config``.

    The shared fields are `ConnectorConfig`'s; the ones listed here are specific or say more.
    Built by `ConnectorConfig.from_kv_transfer_config`; the extra-config keys are the names of
    the attributes below, each optional with the default it shows.

    Attributes:
        kv_port: Base port of the side channel (P workers bind ``kv_port + offset``).
        host: Interface P workers bind and advertise (never a wildcard).
        decode: D's topology (required on both roles; ``pp_size`` must be 1).
        lease_s: How long P keeps a finished request's blocks without hearing from D.
        pull_timeout_s: How long D waits for a request's pulls before reporting its blocks failed.
        quarantine_s: After a failed read, how long D still holds the request's blocks (not
            reported finished) because the engine may write into them late (Mooncake #4247).
        rpc_timeout_s: Deadline of one side-channel attempt.
        rpc_retries: Attempts per side-channel request.
        recv_workers: Read threads of D's lane to each P instance.
        peer_retry_s: After a P instance stops answering, how long D fails its requests at once
            before letting one through to see whether it answers again.
        extra: The whole ``kv_connector_extra_config`` as given (kept for inspection).
    """

    lease_s: float = option(60.0, seconds())
    pull_timeout_s: float = option(60.0, seconds())
    quarantine_s: float = option(1.0, seconds(allow_zero=True))
    rpc_timeout_s: float = option(1.0, seconds())
    rpc_retries: int = option(2, ints(1, 10))
    recv_workers: int = option(4, ints(1, 64))
    peer_retry_s: float = option(1.0, seconds())
    extra: dict[str, Any] = field(default_factory=dict, metadata=WHOLE_EXTRA)

    TOPOLOGY_EXPECTED: ClassVar[str] = "a dict with tp_size and dp_size"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.decode.pp_size != 1:
            raise ConfigError("decode.pp_size", self.decode.pp_size, "1 (D does not support pipeline parallelism)")
        p = self.prefill
        top = self.kv_port + p.dp_size * p.tp_size * p.pp_size * p.pcp_size
        if top > 65536:
            raise ConfigError("kv_port", self.kv_port, "a base leaving room for every P worker's port (<= 65535)")

    @property
    def uses_cp(self) -> bool:
        """Whether either side uses context parallelism (the pull is planned by `cp_plan`)."""
        return self.prefill.cp_size * self.decode.cp_size > 1
