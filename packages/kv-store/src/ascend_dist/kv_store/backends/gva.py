"""The GVA side of the backend Protocol: one object per block in global memory (memcache).

Runs in: worker processes (the layer-wise GVA path, `ascend_dist.kv_store.transfer.gva_layerwise`) and the
rank-0 lookup. Life of an object:

* a writer reserves it with `GvaBackend.alloc` (its global virtual address, GVA; an existing key
  gives <= 0), copies each layer into it with `GvaBackend.copy` as the forward pass produces that
  layer (layers packed back to back), and publishes it with `GvaBackend.write_finish` once every
  layer was copied; until then readers see it as absent (`key_info` size 0, a lease answers
  `UNMATCHED_STATE`);
* a reader asks `key_info` for the GVA, takes a lease (`add_lease`) so the object cannot be evicted
  while it copies layers out, and releases it after its last layer (`remove_lease`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol, runtime_checkable

from ascend_dist.kv_store.backends.base import PoolBackend

__all__ = ["G2L", "L2G", "LEASE_TTL_MS", "UNMATCHED_STATE", "GvaBackend"]

L2G: Final = 0
"""Copy direction: local device memory -> global memory (a save)."""
G2L: Final = 1
"""Copy direction: global memory -> local device memory (a load)."""
UNMATCHED_STATE: Final = -3101
"""memcache: the object is not in a state that allows the call (e.g. not yet published)."""
LEASE_TTL_MS: Final = 300_000
"""Read lease taken for the duration of one step's layer copies (released after the last layer)."""


@runtime_checkable
class GvaBackend(PoolBackend, Protocol):
    """A `PoolBackend` whose objects live at global addresses that workers copy to and from."""

    def key_info(self, keys: Sequence[str]) -> list[tuple[int, int]]:
        """``(size, gva)`` per key; size 0 when the object is absent or not yet published.

        Raises:
            StoreError: The store cannot be asked.
        """
        ...

    def alloc(self, keys: Sequence[str], sizes: Sequence[int]) -> list[int]:
        """Reserve one object per key; its GVA, or <= 0 per failure (an existing key fails).

        Raises:
            StoreError: The store cannot be reached.
        """
        ...

    def add_lease(self, keys: Sequence[str], ttl_ms: int) -> list[int]:
        """Protect published objects from eviction for ``ttl_ms``; 0 per leased key.

        Raises:
            StoreError: The store cannot be reached.
        """
        ...

    def remove_lease(self, keys: Sequence[str]) -> int:
        """Release leases taken with `add_lease`; 0 on success."""
        ...

    def write_finish(self, keys: Sequence[str], results: Sequence[int]) -> list[int]:
        """Publish allocated objects (result 0) or drop them (non-zero); 0 per key handled.

        Raises:
            StoreError: The store cannot be reached.
        """
        ...

    def copy(self, gvas: Sequence[int], addrs: Sequence[int], sizes: Sequence[int], direction: int) -> int:
        """Copy ``sizes[i]`` bytes between ``gvas[i]`` and ``addrs[i]`` (`L2G` or `G2L`); 0 or an error code."""
        ...
