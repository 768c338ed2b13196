"""Configuration of the pull connector, parsed from vLLM's ``kv_transfer_config`` fields.

Runs in: scheduler and worker processes. Pure: no I/O. Every bad value raises `ConfigError`
naming the field and the values it accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ascend_dist.common.errors import ConfigError
from ascend_dist.kv_mooncake.core.config import (
    PROTOCOLS,
    ConnectorConfig,
    Role,
    Topology,
    int_field,
    parse_common,
    seconds_field,
)

__all__ = ["PROTOCOLS", "PullConfig", "Role", "Topology"]


@dataclass(frozen=True)
class PullConfig(ConnectorConfig):
    """Everything the pull connector reads from the ``kv_transfer_config``.

    The shared fields are `ConnectorConfig`'s; the ones listed here are specific or say more.

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
        recv_workers: Threads of D's receiving pool.
    """

    lease_s: float = 60.0
    pull_timeout_s: float = 60.0
    quarantine_s: float = 1.0
    rpc_timeout_s: float = 1.0
    rpc_retries: int = 2
    recv_workers: int = 4
    extra: dict[str, Any] = field(default_factory=dict)

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

    @classmethod
    def from_kv_transfer_config(
        cls,
        *,
        engine_id: object,
        kv_role: object,
        kv_port: object,
        extra: Mapping[str, Any] | None,
        model: str = "",
        dtype: str = "",
    ) -> PullConfig:
        """Parse the fields of vLLM's ``KVTransferConfig`` (passed as plain values).

        Extra-config keys: ``prefill``, ``decode`` (required), ``mooncake_protocol`` (``tcp``),
        ``host`` (``127.0.0.1``), ``dp_rank`` (0), ``lease_s`` (60), ``pull_timeout_s`` (60), ``quarantine_s`` (1.0),
        ``rpc_timeout_s`` (1.0),
        ``rpc_retries`` (2), ``recv_workers`` (4), ``max_message_bytes`` (4 MiB).

        Raises:
            ConfigError: Any field is missing or invalid; the error names it.
        """
        extra = dict(extra or {})
        common = parse_common(
            engine_id=engine_id,
            kv_role=kv_role,
            kv_port=kv_port,
            extra=extra,
            topology_expected="a dict with tp_size and dp_size",
        )
        return cls(
            **common,
            dp_rank=int_field("dp_rank", extra.get("dp_rank", 0), 0),
            lease_s=seconds_field("lease_s", extra.get("lease_s", 60.0)),
            pull_timeout_s=seconds_field("pull_timeout_s", extra.get("pull_timeout_s", 60.0)),
            quarantine_s=seconds_field("quarantine_s", extra.get("quarantine_s", 1.0), allow_zero=True),
            rpc_timeout_s=seconds_field("rpc_timeout_s", extra.get("rpc_timeout_s", 1.0)),
            rpc_retries=int_field("rpc_retries", extra.get("rpc_retries", 2), 1, 10),
            recv_workers=int_field("recv_workers", extra.get("recv_workers", 4), 1, 64),
            max_message_bytes=int_field("max_message_bytes", extra.get("max_message_bytes", 4 * 1024 * 1024), 1024),
            model=model,
            dtype=dtype,
            extra=extra,
        )
