"""Internal base for descriptor batches: three parallel, read-only int64 columns.

Runs in: any process. Pure numpy. Shared by the P2P `Descriptors` (local, remote, lengths) and the
offload `CopyDescriptors` (src, dst, sizes), which differ only in their column names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, Self

import numpy as np
import numpy.typing as npt

from ascend_dist.common.errors import ConfigError

__all__ = ["AddressTriple", "chunk_bounds", "frozen_columns", "frozen_int64"]


def frozen_int64(value: object, field: str) -> npt.NDArray[np.int64]:
    """Copy `value` into a read-only 1-D int64 array.

    Raises:
        ConfigError: `value` is not 1-D or not integral.
    """
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ConfigError(field, f"<array of shape {arr.shape}>", "a 1-D array of integers")
    if arr.size and arr.dtype.kind not in "iu":
        raise ConfigError(field, f"<{arr.dtype} array>", "an integer array")
    out = np.array(arr, dtype=np.int64)
    out.setflags(write=False)
    return out


def frozen_columns(columns: Sequence[tuple[str, object]]) -> list[npt.NDArray[np.int64]]:
    """Freeze several parallel columns and check they have one length.

    Args:
        columns: ``(field name, values)`` pairs; the first sets the expected length.

    Returns:
        The frozen arrays, in order.

    Raises:
        ConfigError: a column is not a 1-D integer array or its length differs from the first.
    """
    arrays = [frozen_int64(values, name) for name, values in columns]
    first_name, first = columns[0][0], arrays[0]
    for (name, _), arr in zip(columns[1:], arrays[1:], strict=True):
        if arr.size != first.size:
            expected = f"as many entries as {first_name} ({first.size})"
            raise ConfigError(name, f"<{arr.size} entries>", expected)
    return arrays


def chunk_bounds(total: int, limit: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index pairs cutting `total` items into pieces of at most `limit`.

    Raises:
        ConfigError: `limit` is not a positive integer.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ConfigError("limit", limit, "a positive integer")
    return [(start, min(start + limit, total)) for start in range(0, total, limit)]


class AddressTriple:
    """Mixin for a frozen dataclass with two address columns and one byte-count column.

    Subclasses are ``@dataclass(frozen=True, eq=False)`` with three array fields named by
    `COLUMNS` (addresses first, sizes last) and call `_freeze` from ``__post_init__``.
    """

    COLUMNS: ClassVar[tuple[str, str, str]]

    if TYPE_CHECKING:

        def __init__(self, first: object, second: object, third: object, /) -> None:
            """Signature of the dataclass constructors of the subclasses."""

    def _freeze(self) -> None:
        """Replace the columns by read-only int64 copies; check lengths and value ranges."""
        arrays = frozen_columns([(name, getattr(self, name)) for name in self.COLUMNS])
        for position, (name, arr) in enumerate(zip(self.COLUMNS, arrays, strict=True)):
            low = 1 if position == 2 else 0
            bad = np.flatnonzero(arr < low)
            if bad.size:
                expected = "a positive byte count" if low else "a non-negative address"
                raise ConfigError(f"{name}[{bad[0]}]", int(arr[bad[0]]), expected)
            object.__setattr__(self, name, arr)

    def _columns(self) -> tuple[npt.NDArray[np.int64], ...]:
        return tuple(getattr(self, name) for name in self.COLUMNS)

    def __len__(self) -> int:
        return int(self._columns()[2].size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(count={len(self)}, total_bytes={self.total_bytes})"

    @property
    def total_bytes(self) -> int:
        """Sum of all byte counts."""
        return int(self._columns()[2].sum())

    @classmethod
    def empty(cls) -> Self:
        """A batch with no pieces."""
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none, none)

    @classmethod
    def concat(cls, *parts: Self | Iterable[Self]) -> Self:
        """Concatenate batches in order: ``concat(a, b)`` or ``concat([a, b, c])``.

        Returns:
            One batch holding every piece of `parts`, in order.
        """
        flat: list[Self] = []
        for part in parts:
            flat.extend([part] if isinstance(part, AddressTriple) else part)
        if not flat:
            return cls.empty()
        columns = [np.concatenate([p._columns()[i] for p in flat]) for i in range(3)]
        return cls(*columns)

    def slice(self, start: int, stop: int) -> Self:
        """Pieces ``[start, stop)`` as a new batch."""
        first, second, third = (column[start:stop] for column in self._columns())
        return type(self)(first, second, third)

    def split(self, limit: int) -> list[Self]:
        """Consecutive batches of at most `limit` pieces, in order (none for an empty batch).

        Raises:
            ConfigError: `limit` is not a positive integer.
        """
        return [self.slice(start, stop) for start, stop in chunk_bounds(len(self), limit)]
