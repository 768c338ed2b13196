"""A test hook that proves a pool load wrote every destination it reported loaded, with the right bytes.

A load that "succeeds" without moving bytes (a repeated key in one batch ``get``, a skipped load)
leaves whatever the block held before: stale KV that the forward pass then uses. `LoadVerifier`
makes that visible. Before the load, every destination block is filled with a sentinel; after it,
every destination not reported failed must hold exactly the bytes expected for it (what the store
holds for its key, or what the instance that saved it computed). A block still holding the
sentinel was never written; a block holding the bytes meant for another destination got someone
else's KV. The error names the request and the block.

Pure Python over the caller's ``read``/``fill`` callables (no torch or kv-store import), so any
test of any cache layout can use it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

__all__ = ["Destination", "LoadVerificationError", "LoadVerifier"]


@dataclass(frozen=True)
class Destination:
    """One block a load must write: the request it belongs to and the bytes it must end up holding."""

    req_id: str
    block_id: int
    want: bytes


class LoadVerificationError(AssertionError):
    """A destination of a load reported successful is unwritten or holds wrong bytes."""


class LoadVerifier:
    """Arm before a load (sentinel in every destination), check after it (see the module docstring)."""

    def __init__(self, read: Callable[[int], bytes], fill: Callable[[Sequence[int]], None]) -> None:
        """``read(block)``: every byte of one block; ``fill(blocks)``: overwrite them with one sentinel value."""
        self._read = read
        self._fill = fill
        self._dests: tuple[Destination, ...] = ()
        self._sentinel = b""

    def arm(self, destinations: Sequence[Destination]) -> None:
        """Fill every destination block with the sentinel; it must differ from every expected content.

        Raises:
            LoadVerificationError: The sentinel equals some expected bytes (an unwritten block
                could not be told apart), or the destinations' blocks read back differently.
        """
        blocks = sorted({d.block_id for d in destinations})
        self._fill(blocks)
        filled = {b: self._read(b) for b in blocks}
        if len(set(filled.values())) > 1:
            raise LoadVerificationError("the sentinel fill left blocks with different bytes")
        self._sentinel = next(iter(filled.values()), b"")
        clash = [d for d in destinations if d.want == self._sentinel]
        if clash:
            raise LoadVerificationError(f"the sentinel equals the expected bytes of {_name(clash[0])}")
        self._dests = tuple(destinations)

    def problems(self, failed_blocks: Collection[int] = ()) -> list[str]:
        """One line per destination (outside ``failed_blocks``, the blocks reported as load errors) with wrong bytes."""
        out: list[str] = []
        for dest in self._dests:
            if dest.block_id in failed_blocks:
                continue
            got = self._read(dest.block_id)
            if got == dest.want:
                continue
            if got == self._sentinel:
                out.append(f"{_name(dest)}: never written (still holds the sentinel)")
                continue
            owner = next((o for o in self._dests if o.want == got and o.want != dest.want), None)
            if owner is not None:
                out.append(f"{_name(dest)}: holds the bytes meant for {_name(owner)}")
            else:
                diff = next((i for i, (a, b) in enumerate(zip(got, dest.want, strict=False)) if a != b), len(got))
                out.append(f"{_name(dest)}: holds other bytes (first difference at byte {diff} of {len(dest.want)})")
        return out

    def check(self, failed_blocks: Collection[int] = ()) -> None:
        """Raise naming every wrong destination (blocks in ``failed_blocks`` were reported failed: skipped).

        Raises:
            LoadVerificationError: Some destination is unwritten or holds wrong bytes; or nothing was armed.
        """
        if not self._dests:
            raise LoadVerificationError("check() before arm(): nothing to verify")
        found = self.problems(failed_blocks)
        if found:
            raise LoadVerificationError(f"{len(found)} destination(s) wrong after a load:\n" + "\n".join(found))


def _name(dest: Destination) -> str:
    return f"request {dest.req_id!r} block {dest.block_id}"
