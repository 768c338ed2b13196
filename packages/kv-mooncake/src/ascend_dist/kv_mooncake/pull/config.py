"""Configuration of the pull connector, parsed from vLLM's ``kv_transfer_config`` fields.

Runs in: scheduler and worker processes. No I/O beyond one environment variable: as upstream,
``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` (seconds) is the default of ``lease_s`` when the extra
config does not set it. Every bad value raises `ConfigError` naming the field (or the variable)
and the values it accepts.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Self

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
    seconds_field,
)
from ascend_dist.kv_mooncake.pull.messages import MAX_BATCH

__all__ = ["ABORT_TIMEOUT_ENV", "PROTOCOLS", "PullConfig", "Role", "Topology"]

ABORT_TIMEOUT_ENV: Final = "VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT"
"""Upstream's lease of P's lent blocks (seconds); our ``lease_s`` default when it is set."""


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
        lease_s: How long P keeps a finished request's blocks without hearing from D (default
            ``$VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` when set, else 60); also how long a
            request may stay in P's batch with no end seen before P forgets it.
        pull_timeout_s: How long D waits for a request's pulls before reporting its blocks failed.
        quarantine_s: After a failed read, how long D still holds the request's blocks (not
            reported finished) because the engine may write into them late (Mooncake #4247).
        cut_hold_s: After D cut its connections to a P to end a read still running one
            ``pull_timeout_s`` past the deadline (a link down), how long it still holds the
            request's blocks: pieces Mooncake still queues for that P are sent when the link
            returns, and must land while the blocks are held.
        rpc_timeout_s: Deadline of one side-channel attempt.
        rpc_retries: Attempts per side-channel request.
        recv_workers: Readers of D's lane to each P instance: each takes up to
            ``recv_batch_requests`` queued tasks of that P, asks P once whether it holds them and
            reads them one request per engine call, so at most this many threads per P wait on
            Mooncake and this many requests of it are read at once (each sleeps through most of
            its read, then busy-waits a core for the rest: `core.transfer_pace`).
        recv_batch_requests: Most tasks one reader takes at once (the rest go to the other
            readers or its next batch).
        recv_batch_bytes: Most bytes one lease check covers (a larger batch is asked about in
            several; a single larger task alone).
        peer_retry_s: After a P instance stops answering, how long D fails its requests at once
            before letting one through to see whether it answers again.
        extra: The whole ``kv_connector_extra_config`` as given (kept for inspection).
    """

    lease_s: float = option(60.0, seconds())
    pull_timeout_s: float = option(60.0, seconds())
    quarantine_s: float = option(1.0, seconds(allow_zero=True))
    cut_hold_s: float = option(30.0, seconds(allow_zero=True))
    rpc_timeout_s: float = option(1.0, seconds())
    rpc_retries: int = option(2, ints(1, 10))
    recv_workers: int = option(2, ints(1, 64))
    recv_batch_requests: int = option(4, ints(1, MAX_BATCH))
    recv_batch_bytes: int = option(256 * 1024 * 1024, ints(1024 * 1024, 1 << 40))
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
        environ: Mapping[str, str] | None = None,
    ) -> Self:
        """`ConnectorConfig.from_kv_transfer_config`, with ``lease_s`` defaulting to upstream's variable.

        Raises:
            ConfigError: As the base; ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` is not seconds > 0.
        """
        config = super().from_kv_transfer_config(
            engine_id=engine_id, kv_role=kv_role, kv_port=kv_port, extra=extra, model=model, dtype=dtype
        )
        raw = (os.environ if environ is None else environ).get(ABORT_TIMEOUT_ENV, "")
        if "lease_s" in (extra or {}) or not raw.strip():
            return config
        try:
            value: object = float(raw)
        except ValueError:
            value = raw
        return dataclasses.replace(config, lease_s=seconds_field(ABORT_TIMEOUT_ENV, value))

    @property
    def uses_cp(self) -> bool:
        """Whether either side uses context parallelism (the pull is planned by `cp_plan`)."""
        return self.prefill.cp_size * self.decode.cp_size > 1
