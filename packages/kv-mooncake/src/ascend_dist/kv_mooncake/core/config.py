"""The config base of the pull, layer-wise and SFA connectors: parses their ``kv_transfer_config``.

Runs in: scheduler and worker processes. Pure apart from the node defaults: a config without
``host`` or ``mooncake_protocol`` takes this node's address and its device runtime's transport
(`core.node`). `ConnectorConfig` owns the keys every
connector reads the same way (``kv_role``, ``kv_port``, the ``prefill`` / ``decode`` topologies,
``host``, ``mooncake_protocol``, ``dp_rank``, ``max_message_bytes``) and the one parser,
`ConnectorConfig.from_kv_transfer_config`. A transport's config declares only its own keys, each
as a dataclass field made by `option` (default + parser), so a key's default is written once.
Every bad value raises `ConfigError` naming the field and the values it accepts.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypedDict, TypeVar

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.core.node import device_protocol, node_address

__all__ = [
    "MAX_MESSAGE_BYTES",
    "PROTOCOLS",
    "WHOLE_EXTRA",
    "CommonFields",
    "ConnectorConfig",
    "FieldParser",
    "Role",
    "Topology",
    "bool_field",
    "check_common",
    "host_list",
    "int_field",
    "ints",
    "opt_str_field",
    "option",
    "option_metadata",
    "parse_common",
    "seconds",
    "seconds_field",
    "text",
]

_T = TypeVar("_T")

FieldParser = Callable[[str, object], Any]
"""Turns one raw extra-config value into a field value; the ``str`` is the name errors give."""

PROTOCOLS = ("tcp", "rdma", "ascend")
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Upper bound of ``max_message_bytes``: each server may queue about twice this (see `RpcServer`)."""
"""Mooncake transport protocols: ``tcp`` on a CPU machine, ``ascend`` on Ascend, ``rdma`` on GPU."""


class Role(enum.Enum):
    """Which side of the P/D pair a process serves."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"


def int_field(name: str, value: object, low: int, high: int | None = None) -> int:
    """An int (or a str of digits) in ``[low, high]``.

    Raises:
        ConfigError: Not an int, a bool, or out of range; the error names ``name``.
    """
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"an int >= {low}" + (f" and <= {high}" if high is not None else "")
        raise ConfigError(name, value, bound)
    return value


def seconds_field(name: str, value: object, *, allow_zero: bool = False) -> float:
    """A finite number of seconds, > 0 (or >= 0 with ``allow_zero``).

    Raises:
        ConfigError: Not a number, a bool, not finite or out of range; the error names ``name``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        raise ConfigError(name, value, "a finite number of seconds " + (">= 0" if allow_zero else "> 0"))
    return float(value)


def bool_field(name: str, value: object) -> bool:
    """A JSON boolean (no truthy strings or ints).

    Raises:
        ConfigError: Not a bool; the error names ``name``.
    """
    if not isinstance(value, bool):
        raise ConfigError(name, value, "true or false")
    return value


def opt_str_field(name: str, value: object) -> str | None:
    """A file path, or None for ``None`` / ``""``.

    Raises:
        ConfigError: Neither a str nor null; the error names ``name``.
    """
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(name, value, "a file path (str) or null")
    return value


def seconds(*, allow_zero: bool = False) -> FieldParser:
    """A `FieldParser` of `seconds_field`."""
    return lambda name, value: seconds_field(name, value, allow_zero=allow_zero)


def ints(low: int, high: int | None = None) -> FieldParser:
    """A `FieldParser` of `int_field` in ``[low, high]``."""
    return lambda name, value: int_field(name, value, low, high)


def host_list(name: str, value: object) -> tuple[str, ...]:
    """A `FieldParser` of host names: a list of strings, or one comma-separated string."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(h, str) and h.strip() for h in items):
        raise ConfigError(name, value, "a list of host names or addresses (or one comma-separated string)")
    return tuple(h.strip().lower().strip("[]") for h in items)


def text(_name: str, value: object) -> str:
    """A `FieldParser` taking any value as its ``str`` (checked later by ``__post_init__``)."""
    return str(value)


@dataclass(frozen=True)
class _Option:
    parse: FieldParser
    key: str  # the extra-config key; "" = the attribute's name
    label: str  # the field errors name; "" = the key


_OPTION = "ascend_dist.kv_mooncake.option"
_WHOLE_EXTRA = "ascend_dist.kv_mooncake.whole_extra"


def option_metadata(parse: FieldParser, *, key: str = "", label: str = "") -> dict[str, Any]:
    """The ``field(metadata=...)`` that makes a field an option (for a ``default_factory`` field)."""
    return {_OPTION: _Option(parse, key, label)}


def option(default: _T, parse: FieldParser, *, key: str = "", label: str = "") -> _T:
    """A config field read from ``kv_connector_extra_config[key]`` (the attribute's name by default).

    A missing key keeps ``default``; a present one goes through ``parse(label or key, value)``.
    """
    return field(default=default, metadata=option_metadata(parse, key=key, label=label))


WHOLE_EXTRA: Mapping[str, Any] = {_WHOLE_EXTRA: True}
"""``field(default_factory=dict, metadata=WHOLE_EXTRA)`` holds a copy of the whole extra config."""


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
        tp = int_field(f"{name}.tp_size", raw["tp_size"], 1)
        dp = int_field(f"{name}.dp_size", raw.get("dp_size", 1), 1)
        pp = int_field(f"{name}.pp_size", raw.get("pp_size", 1), 1)
        part_raw = raw.get("pp_layer_partition") or ()
        if isinstance(part_raw, str):
            try:
                part = tuple(int(x) for x in part_raw.split(","))
            except ValueError as exc:
                raise ConfigError(f"{name}.pp_layer_partition", part_raw, "comma-separated ints") from exc
        elif isinstance(part_raw, list | tuple):
            part = tuple(int_field(f"{name}.pp_layer_partition", x, 1) for x in part_raw)
        else:
            raise ConfigError(f"{name}.pp_layer_partition", part_raw, "a list of ints or 'a,b,...'")
        if part and len(part) != pp:
            raise ConfigError(f"{name}.pp_layer_partition", part_raw, f"{pp} entries (one per PP stage)")
        pcp = int_field(f"{name}.pcp_size", raw.get("pcp_size", 1), 1)
        dcp = int_field(f"{name}.dcp_size", raw.get("dcp_size", 1), 1)
        if tp % dcp:
            raise ConfigError(f"{name}.dcp_size", dcp, f"a divisor of {name}.tp_size={tp}")
        if (pcp > 1 or dcp > 1) and pp > 1:
            raise ConfigError(f"{name}.pp_size", pp, "1 with context parallelism")
        return cls(tp, dp, pp, part, pcp, dcp)


class CommonFields(TypedDict):
    """The constructor arguments every connector's config parses the same way (see `parse_common`)."""

    engine_id: str
    role: Role
    kv_port: int
    prefill: Topology
    decode: Topology
    host: str
    protocol: str


def parse_common(
    *, engine_id: object, kv_role: object, kv_port: object, extra: Mapping[str, Any], topology_expected: str
) -> CommonFields:
    """Parse the keys shared by every connector's ``kv_transfer_config``.

    Args:
        engine_id: ``KVTransferConfig.engine_id`` (a non-str becomes ``""``, refused by `check_common`).
        kv_role: ``kv_producer`` or ``kv_consumer``.
        kv_port: The side channel's base port.
        extra: ``kv_connector_extra_config``: ``prefill`` and ``decode`` are required,
            ``host`` (this node's address, `node_address`) and ``mooncake_protocol`` (from the
            device runtime, `device_protocol`; vllm-ascend's ``use_ascend_direct: true`` means
            ``ascend``) optional.
        topology_expected: What the error says a missing ``prefill`` / ``decode`` should be.

    Raises:
        ConfigError: A field is missing or invalid; the error names it.
    """
    roles = {r.value: r for r in Role}
    if kv_role not in roles:
        raise ConfigError("kv_role", kv_role, "kv_producer or kv_consumer")
    for key in ("prefill", "decode"):
        if key not in extra:
            raise ConfigError(f"kv_connector_extra_config.{key}", None, topology_expected)
    return CommonFields(
        engine_id=engine_id if isinstance(engine_id, str) else "",
        role=roles[str(kv_role)],
        kv_port=int_field("kv_port", kv_port, 1, 65535),
        prefill=Topology.parse("prefill", extra["prefill"]),
        decode=Topology.parse("decode", extra["decode"]),
        host=str(extra["host"]) if "host" in extra else node_address(),
        protocol=_protocol(extra),
    )


_ASCEND_DIRECT = "kv_connector_extra_config.use_ascend_direct"


def _protocol(extra: Mapping[str, Any]) -> str:
    """``mooncake_protocol`` (default: the device runtime's), or what vllm-ascend's guides write instead.

    Their Mooncake guides set ``use_ascend_direct: true`` (Mooncake's Ascend transport): that is
    ``mooncake_protocol: "ascend"`` here. ``false`` (their older HCCL transport) is not built, and a
    ``mooncake_protocol`` that disagrees with the flag is refused rather than guessed.

    Raises:
        ConfigError: ``use_ascend_direct`` is not a bool, is false, or contradicts ``mooncake_protocol``.
    """
    if "use_ascend_direct" not in extra:
        return str(extra["mooncake_protocol"]) if "mooncake_protocol" in extra else device_protocol()
    protocol = str(extra.get("mooncake_protocol", "ascend"))
    direct = bool_field(_ASCEND_DIRECT, extra["use_ascend_direct"])
    if not direct:
        raise ConfigError(_ASCEND_DIRECT, False, 'true, or leave it out and set mooncake_protocol ("tcp", "rdma" or '
                          '"ascend"): the HCCL transport it selects in vllm-ascend is not built here')  # fmt: skip
    if "mooncake_protocol" in extra and protocol != "ascend":
        expected = f'to be left out with mooncake_protocol={protocol!r} (true means "ascend")'
        raise ConfigError(_ASCEND_DIRECT, True, expected)
    return "ascend"


def check_common(engine_id: object, protocol: str, host: str) -> None:
    """Validate the shared fields of a built config (its ``__post_init__``).

    Raises:
        ConfigError: Empty ``engine_id``, unknown ``mooncake_protocol`` or a wildcard/malformed ``host``.
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise ConfigError("engine_id", engine_id, "a non-empty str unique per instance")
    if protocol not in PROTOCOLS:
        raise ConfigError("mooncake_protocol", protocol, f"one of {', '.join(PROTOCOLS)}")
    tcp_endpoint(host, 0)  # refuses wildcards and malformed hosts


@dataclass(frozen=True)
class ConnectorConfig:
    """The fields every connector's config has (`PullConfig`, `LayerwiseConfig`, `SfaConfig` extend it).

    Attributes:
        engine_id: This instance's id; a peer with the same id is refused.
        role: Producer (P, prefill) or consumer (D, decode).
        kv_port: Base port of the side channel (each connector says which side binds what).
        prefill: P's topology (required on both roles).
        decode: D's topology (required on both roles).
        host: Interface this side binds and advertises (never a wildcard).
        protocol: Mooncake transport (``tcp``, ``rdma``, ``ascend``).
        dp_rank: This instance's data-parallel rank.
        max_message_bytes: Largest side-channel message accepted (1 KiB to `MAX_MESSAGE_BYTES`).
        metaserver_hosts: The only hosts a request's ``metaserver`` URL may name (D POSTs its
            contact and block ids there); loopback by default. Set it to the proxy's host(s).
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
    dp_rank: int = option(0, ints(0))
    max_message_bytes: int = option(4 * 1024 * 1024, ints(1024, MAX_MESSAGE_BYTES))
    model: str = ""
    dtype: str = ""
    metaserver_hosts: tuple[str, ...] = option(("127.0.0.1", "localhost", "::1"), host_list)

    TOPOLOGY_EXPECTED: ClassVar[str] = "a dict with tp_size (and dp_size)"
    """What the error says a missing ``prefill`` / ``decode`` should be."""

    def __post_init__(self) -> None:
        """Validate the shared fields (see `check_common`)."""
        check_common(self.engine_id, self.protocol, self.host)

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
    ) -> Self:
        """Parse the fields of vLLM's ``KVTransferConfig`` (passed as plain values).

        The shared keys go through `parse_common`; every field made by `option` (this class's
        and the transport's) is read from ``extra`` under its key, or keeps its default.

        Raises:
            ConfigError: Any field is missing or invalid; the error names it.
        """
        extra = dict(extra or {})
        values: dict[str, Any] = dict(
            parse_common(
                engine_id=engine_id,
                kv_role=kv_role,
                kv_port=kv_port,
                extra=extra,
                topology_expected=cls.TOPOLOGY_EXPECTED,
            )
        )
        for f in dataclasses.fields(cls):
            if f.metadata.get(_WHOLE_EXTRA):
                values[f.name] = extra
                continue
            opt: _Option | None = f.metadata.get(_OPTION)
            if opt is None:
                continue
            key = opt.key or f.name
            if key in extra:  # a missing key keeps the dataclass default (always a valid value)
                values[f.name] = opt.parse(opt.label or key, extra[key])
        return cls(**values, model=model, dtype=dtype)

    @property
    def is_producer(self) -> bool:
        """Whether this process is on P."""
        return self.role is Role.PRODUCER
