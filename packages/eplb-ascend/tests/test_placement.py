"""Placement validation, logical maps and diffs (pure numpy)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from placement_strategies import random_placement

from ascend_dist.common.errors import ConfigError
from ascend_dist.eplb_ascend.errors import PlacementError
from ascend_dist.eplb_ascend.placement import initial_placement, logical_maps, placement_diff, validate_placement


def test_initial_placement_matches_vllm_layout():
    assert initial_placement(4, 6, num_layers=2).tolist() == [[0, 1, 2, 3, 0, 1]] * 2


@pytest.mark.parametrize(
    ("placement", "field", "expected"),
    [
        ([[0, 1, 2, 2]], "expert 3", "at least one replica"),  # expert 3 missing
        ([[0, 1, 2, 3, 3, 3]], "expert 3 replicas", "at most 2"),  # over-replicated beyond max_replicas=2
        ([[0, 1, 2, 4]], "placement[0, 3]", "[0, 4)"),
        ([[0, 1, -1, 3]], "placement[0, 2]", "[0, 4)"),
        ([[0.0, 1.0, 2.0, 3.0]], "placement.dtype", "integer"),
        ([[[0, 1, 2, 3]]], "placement.shape", "[layers, physical_slots]"),
    ],
)
def test_bad_placements_name_the_field(placement, field, expected):
    with pytest.raises(PlacementError) as info:
        validate_placement(placement, num_logical=4, num_ranks=2, max_replicas=2)
    assert field in info.value.field and expected in info.value.expected
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_slots_must_split_over_ranks():
    with pytest.raises(PlacementError, match="num_ranks"):
        validate_placement([[0, 1, 2, 3, 0, 1]], num_logical=4, num_ranks=4)


def test_default_replica_limit_is_all_redundant_slots_on_one_expert():
    validate_placement([[0, 1, 2, 3, 3, 3]], num_logical=4, num_ranks=2)  # 3 replicas = 6 - 4 + 1
    with pytest.raises(PlacementError, match="replicas"):
        validate_placement([[0, 1, 2, 3, 3, 3]], num_logical=4, num_ranks=2, max_replicas=2)


def test_logical_maps_table():
    l2p, count = logical_maps(np.array([[0, 1, 2, 3, 0, 1], [0, 2, 0, 1, 0, 3]]), 4, max_replicas=3)
    assert l2p.tolist() == [
        [[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]],
        [[0, 2, 4], [3, -1, -1], [1, -1, -1], [5, -1, -1]],
    ]
    assert count.tolist() == [[2, 2, 1, 1], [3, 1, 1, 1]]


def test_logical_maps_refuse_a_too_narrow_width():
    with pytest.raises(PlacementError, match="max_replicas"):
        logical_maps(np.array([[0, 0, 0, 1]]), 2, max_replicas=2)


placements = st.integers(1, 4).flatmap(
    lambda ranks: st.integers(1, 3).flatmap(
        lambda per_rank: st.tuples(
            st.just(ranks),
            st.integers(1, ranks * per_rank),
            st.just(ranks * per_rank),
        )
    )
)


@st.composite
def valid_pair(draw):
    ranks, num_logical, slots = draw(placements)
    layers = draw(st.integers(1, 3))

    return (
        ranks,
        num_logical,
        random_placement(draw, layers, slots, num_logical),
        random_placement(draw, layers, slots, num_logical),
    )


@given(valid_pair())
def test_logical_maps_round_trip(case):
    ranks, num_logical, old, _ = case
    validate_placement(old, num_logical=num_logical, num_ranks=ranks)
    l2p, count = logical_maps(old, num_logical)
    for layer in range(old.shape[0]):
        for e in range(num_logical):
            slots = l2p[layer, e, : count[layer, e]]
            assert sorted(slots.tolist()) == slots.tolist() == np.flatnonzero(old[layer] == e).tolist()
            assert (l2p[layer, e, count[layer, e] :] == -1).all()


@given(valid_pair())
def test_diff_fetches_are_what_ranks_newly_need(case):
    ranks, num_logical, old, new = case
    diff = placement_diff(old, new, ranks, num_logical)
    per = old.shape[1] // ranks
    expected = {
        (layer, r, int(e))
        for layer in range(old.shape[0])
        for r in range(ranks)
        for e in set(new[layer, r * per : (r + 1) * per].tolist()) - set(old[layer, r * per : (r + 1) * per].tolist())
    }
    assert {tuple(x) for x in diff.fetches.tolist()} == expected
    assert diff.changed_slots.shape[0] == int((old != new).sum())
