"""Configuration of the pull connector, parsed from vLLM's ``kv_transfer_config`` fields.

Runs in: scheduler and worker processes. Pure: no I/O. Every bad value raises `ConfigError`
naming the field and the values it accepts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.zmq_server import tcp_endpoint

__all__ = ["PROTOCOLS", "PullConfig", "Role", "Topology"]

PROTOCOLS = ("tcp", "rdma", "ascend")
"""Mooncake transport protocols: ``tcp`` on a CPU machine, ``ascend`` on Ascend, ``rdma`` on GPU."""


class Role(enum.Enum):
    """Which side of the P/D pair a process serves."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an int >= {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(name, value, bound)
    return value


def _float(name: str, value: object, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= low:
        raise ConfigError(name, value, f"a number of seconds > {low}")
    return float(value)


def _nonneg(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(name, value, "a number of seconds >= 0")
    return float(value)


@dataclass(frozen=True)
class Topology:
    """Parallel sizes of one instance (``prefill`` or ``decode`` in the extra config).

    Attributes:
        tp_size: Tensor-parallel size.
        dp_size: Data-parallel size.
        pp_size: Pipeline-parallel size (D must be 1).
        pp_layer_partition: Layers per PP stage, or empty for vLLM's default split.
        pcp_size: Prefill context-parallel size (whole TP groups, each with a share of the blocks).
        dcp_size: Decode context-parallel size (divides ``tp_size``).
    """

    tp_size: int
    dp_size: int = 1
    pp_size: int = 1
    pp_layer_partition: tuple[int, ...] = ()
    pcp_size: int = 1
    dcp_size: int = 1

    @property
    def cp_size(self) -> int:
        """``pcp_size * dcp_size``: the block interleaving period."""
        return self.pcp_size * self.dcp_size

    @classmethod
    def parse(cls, name: str, raw: object) -> Topology:
        """Parse ``{tp_size, dp_size, pp_size?, pp_layer_partition?}``.

        Raises:
            ConfigError: A key is missing or out of range; the field is named ``<name>.<key>``.
        """
        if not isinstance(raw, Mapping):
            raise ConfigError(name, raw, "a dict with tp_size, dp_size and optionally pp_size, pp_layer_partition")
        if "tp_size" not in raw:
            raise ConfigError(f"{name}.tp_size", None, "a positive int (required)")
        tp = _int(f"{name}.tp_size", raw["tp_size"], 1)
        dp = _int(f"{name}.dp_size", raw.get("dp_size", 1), 1)
        pp = _int(f"{name}.pp_size", raw.get("pp_size", 1), 1)
        part_raw = raw.get("pp_layer_partition") or ()
        if isinstance(part_raw, str):
            try:
                part = tuple(int(x) for x in part_raw.split(","))
            except ValueError as exc:
                raise ConfigError(f"{name}.pp_layer_partition", part_raw, "comma-separated ints") from exc
        elif isinstance(part_raw, list | tuple):
            part = tuple(_int(f"{name}.pp_layer_partition", x, 1) for x in part_raw)
        else:
            raise ConfigError(f"{name}.pp_layer_partition", part_raw, "a list of ints or 'a,b,...'")
        if part and len(part) != pp:
            raise ConfigError(f"{name}.pp_layer_partition", part_raw, f"{pp} entries (one per PP stage)")
        pcp = _int(f"{name}.pcp_size", raw.get("pcp_size", 1), 1)
        dcp = _int(f"{name}.dcp_size", raw.get("dcp_size", 1), 1)
        if tp % dcp:
            raise ConfigError(f"{name}.dcp_size", dcp, f"a divisor of {name}.tp_size={tp}")
        if (pcp > 1 or dcp > 1) and pp > 1:
            raise ConfigError(f"{name}.pp_size", pp, "1 with context parallelism")
        return cls(tp, dp, pp, part, pcp, dcp)


@dataclass(frozen=True)
class PullConfig:
    """Everything the pull connector reads from the ``kv_transfer_config``.

    Attributes:
        engine_id: This instance's id; a peer with the same id is refused.
        role: Producer (P) or consumer (D).
        kv_port: Base port of the side channel (P workers bind ``kv_port + offset``).
        host: Interface P workers bind and advertise (never a wildcard).
        protocol: Mooncake transport (``tcp``, ``rdma``, ``ascend``).
        prefill: P's topology (required on both roles).
        decode: D's topology (required on both roles; ``pp_size`` must be 1).
        dp_rank: This instance's data-parallel rank.
        lease_s: How long P keeps a finished request's blocks without hearing from D.
        pull_timeout_s: How long D waits for a request's pulls before reporting its blocks failed.
        quarantine_s: After a failed read, how long D still holds the request's blocks (not
            reported finished) because the engine may write into them late (Mooncake #4247).
        rpc_timeout_s: Deadline of one side-channel attempt.
        rpc_retries: Attempts per side-channel request.
        recv_workers: Threads of D's receiving pool.
        max_message_bytes: Largest side-channel message accepted.
        model: Model name (compatibility field).
        dtype: KV dtype name (compatibility field).
    """

    engine_id: str
    role: Role
    kv_port: int
    prefill: Topology
    decode: Topology
    host: str = "127.0.0.1"
    protocol: str = "tcp"
    dp_rank: int = 0
    lease_s: float = 60.0
    pull_timeout_s: float = 60.0
    quarantine_s: float = 1.0
    rpc_timeout_s: float = 1.0
    rpc_retries: int = 2
    recv_workers: int = 4
    max_message_bytes: int = 4 * 1024 * 1024
    model: str = ""
    dtype: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ConfigError("engine_id", self.engine_id, "a non-empty str unique per instance")
        if self.protocol not in PROTOCOLS:
            raise ConfigError("mooncake_protocol", self.protocol, f"one of {', '.join(PROTOCOLS)}")
        tcp_endpoint(self.host, 0)  # refuses wildcards and malformed hosts
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

    @property
    def is_producer(self) -> bool:
        """Whether this process is on P."""
        return self.role is Role.PRODUCER

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
        roles = {r.value: r for r in Role}
        if kv_role not in roles:
            raise ConfigError("kv_role", kv_role, "kv_producer or kv_consumer")
        for key in ("prefill", "decode"):
            if key not in extra:
                raise ConfigError(f"kv_connector_extra_config.{key}", None, "a dict with tp_size and dp_size")
        return cls(
            engine_id=engine_id if isinstance(engine_id, str) else "",
            role=roles[str(kv_role)],
            kv_port=_int("kv_port", kv_port, 1, 65535),
            prefill=Topology.parse("prefill", extra["prefill"]),
            decode=Topology.parse("decode", extra["decode"]),
            host=str(extra.get("host", "127.0.0.1")),
            protocol=str(extra.get("mooncake_protocol", "tcp")),
            dp_rank=_int("dp_rank", extra.get("dp_rank", 0), 0),
            lease_s=_float("lease_s", extra.get("lease_s", 60.0), 0.0),
            pull_timeout_s=_float("pull_timeout_s", extra.get("pull_timeout_s", 60.0), 0.0),
            quarantine_s=_nonneg("quarantine_s", extra.get("quarantine_s", 1.0)),
            rpc_timeout_s=_float("rpc_timeout_s", extra.get("rpc_timeout_s", 1.0), 0.0),
            rpc_retries=_int("rpc_retries", extra.get("rpc_retries", 2), 1, 10),
            recv_workers=_int("recv_workers", extra.get("recv_workers", 4), 1, 64),
            max_message_bytes=_int("max_message_bytes", extra.get("max_message_bytes", 4 * 1024 * 1024), 1024),
            model=model,
            dtype=dtype,
            extra=extra,
        )
