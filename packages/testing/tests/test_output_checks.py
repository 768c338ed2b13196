"""The engine tier's output checks refuse comparisons that would pass by accident.

`Completion` stands in for the engine host's type of that name (the meta-package is not installed
with this member alone): the checks read only these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from ascend_dist.testing.engines import assert_every_output_differs, assert_same_output


@dataclass(frozen=True)
class _Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    error: str | None = None


def Completion(**kw: Any) -> Any:  # reads like the engine host's type
    return _Completion(**kw)


REF = [Completion(token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3])]


def test_same_output_passes_on_equal_tokens_and_refuses_an_empty_reference() -> None:
    assert_same_output([Completion(token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3])], REF)
    with pytest.raises(AssertionError, match="reference has no tokens"):
        assert_same_output([Completion()], [Completion()])
    with pytest.raises(AssertionError, match="no reference"):
        assert_same_output([], [])


def test_control_passes_on_a_full_different_answer_only() -> None:
    assert_every_output_differs([Completion(token_ids=[5, 9, 7])], REF)
    for accidental in (Completion(), Completion(token_ids=[5])):  # empty, cut short
        with pytest.raises(AssertionError, match="proving"):
            assert_every_output_differs([accidental], REF)
    with pytest.raises(AssertionError, match="boom"):
        assert_every_output_differs([Completion(error="boom")], REF)
    with pytest.raises(AssertionError, match="ignored the transfer"):
        assert_every_output_differs([Completion(token_ids=[5, 6, 7])], REF)
