"""Side-channel port-offset scheme: each worker's ZMQ port is a pure function of its position.

Runs in: scheduler and worker processes. Pure: no I/O. A peer computes a worker's port from the
advertised base port and the worker's ranks, without any discovery round-trip (the scheme of vllm-ascend's Mooncake
connectors' ``handshake_port``, v0.11).

Pick ``kv_port`` outside the range Ascend's direct transport draws random ports from
(``[20000, 20000 + NPUs_per_node * 1000)``), or binds fail intermittently with
``Address already in use``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from ascend_dist.common.errors import ConfigError

__all__ = ["MAX_PORT", "PortLayout", "PortScheme", "RankCoord"]

MAX_PORT: Final = 65535


class PortScheme(enum.Enum):
    """Which connector's port layout a `PortLayout` follows.

    All three are the mixed-radix number ``(((dp * pp + pp_rank) * pcp + pcp_rank) * tp + tp_rank)``
    added to ``kv_port``; they differ in which dimension is absent, which is validated:

    * ``PULL`` (MooncakeConnectorV1): dp, pp, pcp, tp. P workers bind, D connects.
    * ``HYBRID`` (MooncakeHybridConnector): no PCP (``pcp_size`` must be 1).
    * ``LAYERWISE`` (MooncakeLayerwiseConnector): no PP (``pp_size`` must be 1). D binds. SFA RD2H
      uses the same layout with the *global* DP rank.
    """

    PULL = "pull"
    HYBRID = "hybrid"
    LAYERWISE = "layerwise"


@dataclass(frozen=True)
class RankCoord:
    """A worker's position in an instance. DCP is not a separate axis: see `RankCoord.dcp_rank`."""

    tp_rank: int
    pp_rank: int = 0
    pcp_rank: int = 0
    dp_rank: int = 0

    def dcp_rank(self, dcp_size: int) -> int:
        """The DCP rank implied by ``tp_rank`` (``tp_rank % dcp_size``)."""
        return self.tp_rank % dcp_size


@dataclass(frozen=True)
class PortLayout:
    """The side-channel ports of one instance: ``kv_port`` plus a deterministic per-rank offset.

    Example: ``kv_port`` 36000, tp 8, pp 2, dp 2 (PULL): DP0 uses 36000..36015 and pp_rank 1,
    tp_rank 3 is ``36000 + (1*1 + 0)*8 + 3 = 36011``; DP1 starts at 36016.

    Attributes:
        kv_port: The configured base port (``kv_connector_extra_config`` / ``kv_port``).
        tp_size: TP size.
        pp_size: PP size (1 for LAYERWISE).
        pcp_size: PCP size (1 for HYBRID).
        dp_size: Number of DP ranks whose ports are laid out (bounds `rank` and the port range).
        scheme: Which connector's layout this is.
    """

    kv_port: int
    tp_size: int
    pp_size: int = 1
    pcp_size: int = 1
    dp_size: int = 1
    scheme: PortScheme = PortScheme.PULL

    def __post_init__(self) -> None:
        """Validate sizes and that every port fits below 65536.

        Raises:
            ConfigError: A size is < 1, the scheme forbids a size > 1, or the last port is > 65535.
        """
        for name in ("kv_port", "tp_size", "pp_size", "pcp_size", "dp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "an integer >= 1")
        if self.scheme is PortScheme.HYBRID and self.pcp_size != 1:
            raise ConfigError("pcp_size", self.pcp_size, "1 for the hybrid port layout")
        if self.scheme is PortScheme.LAYERWISE and self.pp_size != 1:
            raise ConfigError("pp_size", self.pp_size, "1 for the layer-wise port layout")
        if self.max_port > MAX_PORT:
            raise ConfigError("kv_port", self.kv_port, f"a base port whose last worker port ({self.max_port}) <= 65535")

    @property
    def ports_per_dp(self) -> int:
        """Ports used by one DP rank: ``tp * pp * pcp``."""
        return self.tp_size * self.pp_size * self.pcp_size

    @property
    def max_port(self) -> int:
        """The highest port of the layout."""
        return self.kv_port + self.dp_size * self.ports_per_dp - 1

    def dp_base(self, dp_rank: int) -> int:
        """The base port a DP rank advertises (``remote_port``): ``kv_port + dp_rank * tp*pp*pcp``.

        Raises:
            ConfigError: ``dp_rank`` is outside ``[0, dp_size)``.
        """
        self._check_rank("dp_rank", dp_rank, self.dp_size)
        return self.kv_port + dp_rank * self.ports_per_dp

    def port(self, rank: RankCoord) -> int:
        """The side-channel port of a worker.

        Returns:
            ``dp_base(dp) + (pp_rank * pcp + pcp_rank) * tp + tp_rank``.

        Raises:
            ConfigError: A rank is outside its size.
        """
        self._check_rank("tp_rank", rank.tp_rank, self.tp_size)
        self._check_rank("pp_rank", rank.pp_rank, self.pp_size)
        self._check_rank("pcp_rank", rank.pcp_rank, self.pcp_size)
        device_index = (rank.pp_rank * self.pcp_size + rank.pcp_rank) * self.tp_size + rank.tp_rank
        return self.dp_base(rank.dp_rank) + device_index

    def rank(self, port: int) -> RankCoord:
        """The worker that owns a port (inverse of `port`).

        Raises:
            ConfigError: ``port`` is outside ``[kv_port, max_port]``.
        """
        if not self.kv_port <= port <= self.max_port:
            raise ConfigError("port", port, f"a port in [{self.kv_port}, {self.max_port}]")
        offset = port - self.kv_port
        offset, tp_rank = divmod(offset, self.tp_size)
        offset, pcp_rank = divmod(offset, self.pcp_size)
        dp_rank, pp_rank = divmod(offset, self.pp_size)
        return RankCoord(tp_rank=tp_rank, pp_rank=pp_rank, pcp_rank=pcp_rank, dp_rank=dp_rank)

    @staticmethod
    def _check_rank(field: str, value: int, size: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
            raise ConfigError(field, value, f"an integer in [0, {size})")
