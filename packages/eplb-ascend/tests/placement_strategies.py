"""Hypothesis building blocks shared by the placement, plan and mover tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st


def random_placement(
    draw: Callable[[st.SearchStrategy[Any]], Any], layers: int, slots: int, num_logical: int
) -> np.ndarray:
    """`[layers, slots]` expert ids: every logical expert at least once, the spare slots any replicas."""
    rows = []
    for _ in range(layers):
        spare = slots - num_logical
        extra = draw(st.lists(st.integers(0, num_logical - 1), min_size=spare, max_size=spare))
        rows.append(draw(st.permutations(list(range(num_logical)) + extra)))
    return np.array(rows, dtype=np.int64)
