"""Host block pool with reference counts and optional prefix sharing (recompute connector).

Runs in: the scheduler process. Pure Python.

Blocks are taken in one batch or not at all (`allocate` returns None when too few are free: the
caller falls back). With prefix caching on, a block can carry the hash of the full device block it
holds; a freed hashed block stays discoverable until it is handed out again (LRU order).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from ascend_dist.common.errors import BlockIdError, ConfigError

__all__ = ["HostBlockPool"]


class HostBlockPool:
    """``num_blocks`` host blocks ``1..num_blocks`` (0 is the null block), ref-counted."""

    def __init__(self, num_blocks: int) -> None:
        """Create the pool.

        Raises:
            ConfigError: ``num_blocks`` is not positive.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError("num_cpu_blocks", num_blocks, "a positive number of host blocks")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks + 1))
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now (including cached ones not in use)."""
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """Take ``count`` blocks (ref 1 each), or None and take nothing."""
        if count > len(self._free):
            return None
        ids = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash_of.pop(block, None)
            if old is not None:
                del self._block_of[old]
            self._refs[block] = 1
            ids.append(block)
        return ids

    def touch(self, block: int) -> None:
        """Add a reference (a cached free block comes back into use).

        Raises:
            BlockIdError: an unknown block.
        """
        if block in self._refs:
            self._refs[block] += 1
        elif block in self._free and block in self._hash_of:
            del self._free[block]
            self._refs[block] = 1
        else:
            raise BlockIdError("host_block", block, "a block in use or cached")

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per id (0 = null is skipped); at 0 the block is free (hash kept).

        Raises:
            BlockIdError: a block not in use.
        """
        for block in blocks:
            if block == 0:
                continue
            refs = self._refs.get(block)
            if refs is None:
                raise BlockIdError("host_block", block, "a block in use")
            if refs > 1:
                self._refs[block] = refs - 1
            else:
                del self._refs[block]
                self._free[block] = None

    def cached(self, block_hash: bytes) -> int | None:
        """The block holding ``block_hash``, if any."""
        return self._block_of.get(block_hash)

    def set_hash(self, block: int, block_hash: bytes) -> bool:
        """Make ``block`` discoverable by ``block_hash``; False when another block already holds it."""
        if block_hash in self._block_of and self._block_of[block_hash] != block:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True

    def reset(self) -> None:
        """Forget every hash (blocks in use stay in use)."""
        self._hash_of.clear()
        self._block_of.clear()
