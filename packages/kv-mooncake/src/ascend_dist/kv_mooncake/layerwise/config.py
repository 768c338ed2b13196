"""Configuration of the layer-wise push connector, parsed from vLLM's ``kv_transfer_config`` fields.

Runs in: scheduler and worker processes. Pure: no I/O. Every bad value raises `ConfigError`
naming the field and the values it accepts. P's and D's topologies use the pull connector's
`ascend_dist.kv_mooncake.config.Topology` (``prefill`` / ``decode`` keys, both required on both
roles); PP is not supported by the push (spec §4.2: no PP term in its port layout).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.mappings import ParallelInfo, pd_head_ratio
from ascend_dist.common.ports import PortLayout, PortScheme, RankCoord
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.config import PROTOCOLS, Role, Topology

__all__ = ["LayerwiseConfig", "TlsConfig"]


def _int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an int >= {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(name, value, bound)
    return value


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(name, value, "a finite number of seconds > 0")
    return float(value)


def _opt_str(name: str, value: object) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(name, value, "a file path (str) or null")
    return value


@dataclass(frozen=True)
class TlsConfig:
    """TLS options of the metaserver HTTP client (``kv_connector_extra_config.tls_config``).

    Attributes:
        ssl_enable: Use HTTPS (a plain ``http://`` metaserver URL is refused when on).
        ssl_ca_certs: CA bundle that verifies the metaserver; None = the system store.
        ssl_certfile: Client certificate (mutual TLS), or None.
        ssl_keyfile: Key of the client certificate, or None (then it is inside ``ssl_certfile``).
        ssl_keyfile_password: Password of the key, or None.
    """

    ssl_enable: bool = False
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_keyfile_password: str | None = None

    @classmethod
    def parse(cls, raw: object) -> TlsConfig:
        """Parse the ``tls_config`` dict.

        Raises:
            ConfigError: Unknown key or bad type; the field is named ``tls_config.<key>``.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ConfigError("tls_config", raw, "a dict of ssl_enable, ssl_ca_certs, ssl_certfile, ssl_keyfile, ...")
        allowed = {"ssl_enable", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_keyfile_password"}
        for key in raw:
            if key not in allowed:
                raise ConfigError(f"tls_config.{key}", raw[key], f"one of the keys {sorted(allowed)}")
        enable = raw.get("ssl_enable", False)
        if not isinstance(enable, bool):
            raise ConfigError("tls_config.ssl_enable", enable, "true or false")
        keyfile = _opt_str("tls_config.ssl_keyfile", raw.get("ssl_keyfile"))
        certfile = _opt_str("tls_config.ssl_certfile", raw.get("ssl_certfile"))
        if keyfile and not certfile:
            raise ConfigError("tls_config.ssl_certfile", None, "a client certificate when ssl_keyfile is set")
        return cls(
            ssl_enable=enable,
            ssl_ca_certs=_opt_str("tls_config.ssl_ca_certs", raw.get("ssl_ca_certs")),
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            ssl_keyfile_password=_opt_str("tls_config.ssl_keyfile_password", raw.get("ssl_keyfile_password")),
        )


@dataclass(frozen=True)
class LayerwiseConfig:
    """Everything the layer-wise connector reads from the ``kv_transfer_config``.

    Attributes:
        engine_id: This instance's id; a peer with the same id is refused.
        role: Producer (P pushes) or consumer (D receives).
        kv_port: Base port: D workers bind ``kv_port + dp·pcp·tp + pcp_rank·tp + tp_rank``.
        prefill: P's topology (``pp_size`` must be 1).
        decode: D's topology (``pp_size`` must be 1).
        host: Interface D binds and advertises (never a wildcard); P's engine host.
        protocol: Mooncake transport (``tcp``, ``rdma``, ``ascend``).
        dp_rank: This instance's data-parallel rank.
        first_layer_timeout_s: D fails a request when no layer arrived this long after it was
            announced (P's queueing and prefill scheduling included).
        layer_timeout_s: D fails a request when its next layer does not arrive within this
            long after the previous one.
        gate_timeout_s: P's longest wait for a layer's earlier push before its storage is reused.
        rpc_timeout_s: Deadline of one side-channel attempt.
        rpc_retries: Attempts per side-channel request.
        metaserver_timeout_s: Deadline of one metaserver POST attempt (3 attempts).
        max_message_bytes: Largest side-channel message accepted.
        tls: The metaserver client's TLS options.
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
    first_layer_timeout_s: float = 120.0
    layer_timeout_s: float = 30.0
    gate_timeout_s: float = 60.0
    rpc_timeout_s: float = 1.0
    rpc_retries: int = 3
    metaserver_timeout_s: float = 5.0
    max_message_bytes: int = 4 * 1024 * 1024
    tls: TlsConfig = field(default_factory=TlsConfig)
    model: str = ""
    dtype: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ConfigError("engine_id", self.engine_id, "a non-empty str unique per instance")
        if self.protocol not in PROTOCOLS:
            raise ConfigError("mooncake_protocol", self.protocol, f"one of {', '.join(PROTOCOLS)}")
        tcp_endpoint(self.host, 0)  # refuses wildcards and malformed hosts
        for name, topo in (("prefill", self.prefill), ("decode", self.decode)):
            if topo.pp_size != 1:
                raise ConfigError(f"{name}.pp_size", topo.pp_size, "1 (the layer-wise push has no PP)")
        if self.prefill.tp_size % self.decode.tp_size:
            raise ConfigError(
                "decode.tp_size", self.decode.tp_size, f"a divisor of prefill.tp_size={self.prefill.tp_size}"
            )
        _ = self.d_ports  # validates the D port range

    @property
    def is_producer(self) -> bool:
        """Whether this process is on P."""
        return self.role is Role.PRODUCER

    @property
    def d_ports(self) -> PortLayout:
        """D's side-channel port layout (spec §4.2)."""
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
    ) -> LayerwiseConfig:
        """Parse the fields of vLLM's ``KVTransferConfig`` (passed as plain values).

        Extra-config keys: ``prefill``, ``decode`` (required), ``mooncake_protocol`` (``tcp``),
        ``host`` (``127.0.0.1``), ``dp_rank`` (0), ``first_layer_timeout_s`` (120),
        ``layer_timeout_s`` (30), ``gate_timeout_s`` (60), ``rpc_timeout_s`` (1.0),
        ``rpc_retries`` (3), ``metaserver_timeout_s`` (5), ``max_message_bytes`` (4 MiB),
        ``tls_config`` (see `TlsConfig`).

        Raises:
            ConfigError: Any field is missing or invalid; the error names it.
        """
        extra = dict(extra or {})
        roles = {r.value: r for r in Role}
        if kv_role not in roles:
            raise ConfigError("kv_role", kv_role, "kv_producer or kv_consumer")
        for key in ("prefill", "decode"):
            if key not in extra:
                raise ConfigError(f"kv_connector_extra_config.{key}", None, "a dict with tp_size (and dp_size)")
        return cls(
            engine_id=engine_id if isinstance(engine_id, str) else "",
            role=roles[str(kv_role)],
            kv_port=_int("kv_port", kv_port, 1, 65535),
            prefill=Topology.parse("prefill", extra["prefill"]),
            decode=Topology.parse("decode", extra["decode"]),
            host=str(extra.get("host", "127.0.0.1")),
            protocol=str(extra.get("mooncake_protocol", "tcp")),
            dp_rank=_int("dp_rank", extra.get("dp_rank", 0), 0),
            first_layer_timeout_s=_seconds("first_layer_timeout_s", extra.get("first_layer_timeout_s", 120.0)),
            layer_timeout_s=_seconds("layer_timeout_s", extra.get("layer_timeout_s", 30.0)),
            gate_timeout_s=_seconds("gate_timeout_s", extra.get("gate_timeout_s", 60.0)),
            rpc_timeout_s=_seconds("rpc_timeout_s", extra.get("rpc_timeout_s", 1.0)),
            rpc_retries=_int("rpc_retries", extra.get("rpc_retries", 3), 1, 10),
            metaserver_timeout_s=_seconds("metaserver_timeout_s", extra.get("metaserver_timeout_s", 5.0)),
            max_message_bytes=_int("max_message_bytes", extra.get("max_message_bytes", 4 * 1024 * 1024), 1024),
            tls=TlsConfig.parse(extra.get("tls_config")),
            model=model,
            dtype=dtype,
        )
