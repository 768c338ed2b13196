"""One host pool per device for the SFA decode worker and the sparse offload manager.

Runs in: the decode worker process. SFA's D worker (kv-mooncake) reads P's main MLA rows into a
host pool; the sparse offload manager (kv-offload) copies the top-k rows of that pool into its
hot buffers. The two are separate distributions that must not import each other, so they meet
here: each calls `claim_host_pool` with the geometry it needs and an allocator. Whichever claims
first allocates the pool; the second gets the same tensors, or a `ConfigError` naming the first
field on which the two disagree (a pool of another shape would be read as garbage, not refused).
Pools are kept per device index, so each rank of a multi-device process pairs with its own.

A pool is per main layer (in layer order), per part (MLA: nope then rope), one contiguous
``int8`` tensor ``[num_blocks * block_size, token_bytes]``: token ``t`` of block ``b`` is row
``b * block_size + t``. Importing this module does not import torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol

from ascend_dist.common.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "HostPoolGeometry",
    "SharedHostPool",
    "TensorHostPool",
    "claim_host_pool",
    "held_host_pool",
    "release_host_pool",
]


@dataclass(frozen=True)
class HostPoolGeometry:
    """What the sharers must agree on.

    Attributes:
        num_layers: main (MLA) layers.
        num_blocks: blocks per layer.
        block_size: tokens per block.
        token_bytes: bytes per token of each part of a layer (MLA: ``(nope, rope)``).
        token_major: each block holds its tokens' rows one after the other (token ``t`` at byte
            ``t * token_bytes``); the manager reads rows so, a head-major block would be garbage.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    token_bytes: tuple[int, ...]
    token_major: bool = True

    def mismatch(self, other: HostPoolGeometry) -> str | None:
        """The first field on which ``other`` differs, or None."""
        return next((f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)), None)


class SharedHostPool(Protocol):
    """A host pool as both sharers see it (see the module docstring for the tensor shapes)."""

    @property
    def geometry(self) -> HostPoolGeometry:
        """The pool's sizes."""
        ...

    def part(self, layer: int, index: int) -> torch.Tensor:
        """Layer ``layer``'s part ``index``: ``int8 [num_blocks * block_size, token_bytes[index]]``."""
        ...


@dataclass
class _Held:
    pool: SharedHostPool
    owner: str
    holders: int


_LOCK = threading.Lock()
_POOLS: dict[int, _Held] = {}


def _check(pool: SharedHostPool, geo: HostPoolGeometry, owner: str) -> None:
    """Refuse an allocator's pool whose tensors do not have the geometry's shapes (before anyone shares it)."""
    if (field := geo.mismatch(pool.geometry)) is not None:
        raise ConfigError(f"host_pool.{field}", getattr(pool.geometry, field), f"{getattr(geo, field)} ({owner})")
    rows = geo.num_blocks * geo.block_size
    for layer in range(geo.num_layers):
        for i, width in enumerate(geo.token_bytes):
            t = pool.part(layer, i)
            if t.device.type != "cpu" or t.element_size() != 1 or tuple(t.shape) != (rows, width):
                raise ConfigError(
                    f"host_pool.layers[{layer}][{i}]",
                    f"{t.dtype} {tuple(t.shape)} on {t.device}",
                    f"int8 {(rows, width)} on cpu",
                )
            if not t.is_contiguous():
                raise ConfigError(f"host_pool.layers[{layer}][{i}].stride", tuple(t.stride()), "contiguous rows")


def claim_host_pool(
    device_index: int, geometry: HostPoolGeometry, allocate: Callable[[], SharedHostPool], owner: str
) -> SharedHostPool:
    """The device's pool: the one another sharer allocated, else ``allocate()``'s (then held for the next).

    Each claim must be matched by one `release_host_pool`.

    Raises:
        ConfigError: the pool already held has another geometry (``host_pool.<field>``, naming who
            allocated it), or ``allocate`` returned tensors of the wrong shape.
    """
    with _LOCK:
        held = _POOLS.get(device_index)
        if held is not None:
            if (field := geometry.mismatch(held.pool.geometry)) is not None:
                raise ConfigError(
                    f"host_pool.{field}",
                    getattr(geometry, field),
                    f"{getattr(held.pool.geometry, field)}: the pool {held.owner} allocated on device {device_index}",
                )
            held.holders += 1
            return held.pool
        pool = allocate()
        _check(pool, geometry, owner)
        _POOLS[device_index] = _Held(pool, owner, 1)
        return pool


def release_host_pool(device_index: int, pool: SharedHostPool) -> None:
    """Drop one claim on the device's pool; the last one forgets it (a stale ``pool`` is ignored)."""
    with _LOCK:
        held = _POOLS.get(device_index)
        if held is None or held.pool is not pool:
            return
        held.holders -= 1
        if held.holders <= 0:
            del _POOLS[device_index]


def held_host_pool(device_index: int) -> SharedHostPool | None:
    """The device's pool if one is held (diagnostics and tests)."""
    with _LOCK:
        held = _POOLS.get(device_index)
        return held.pool if held else None


@dataclass(frozen=True)
class TensorHostPool:
    """A `SharedHostPool` over given tensors (``parts[layer][index]``)."""

    geometry: HostPoolGeometry
    parts: Sequence[Sequence[torch.Tensor]]

    def part(self, layer: int, index: int) -> torch.Tensor:
        """See `SharedHostPool.part`."""
        return self.parts[layer][index]
