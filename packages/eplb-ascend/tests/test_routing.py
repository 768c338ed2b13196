"""The routing table: reference table tests, device version equal to it, in-place refresh."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dist.eplb_ascend.errors import PlacementError
from ascend_dist.eplb_ascend.placement import logical_maps
from ascend_dist.eplb_ascend.routing import EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS, build_expert_replica_routing_table
from ascend_dist.eplb_ascend.tables import (
    ModelRoutingTables,
    compute_routing_table,
    refresh_expert_replica_routing_table,
    refresh_or_build,
)


def test_table_values_round_robin_with_rank_phase():
    l2p = np.array([[0, 4, -1], [1, -1, -1], [2, 3, 5]])
    count = np.array([2, 1, 3])
    table = build_expert_replica_routing_table(l2p, count, ep_rank=1, num_rows=4)
    # entry (r, e) = l2p[e, (r + 1 + e) % count[e]]
    assert table.tolist() == [[4, 1, 2], [0, 1, 3], [4, 1, 5], [0, 1, 2]]
    assert table.dtype == np.int32 and table.flags.c_contiguous


def test_default_period_is_1024_and_zero_count_uses_column_0():
    table = build_expert_replica_routing_table(np.array([[7, -1]]), np.array([0]), ep_rank=3)
    assert table.shape == (EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS, 1) and (table == 7).all()


@pytest.mark.parametrize(
    ("l2p", "count", "field"),
    [
        (np.zeros((2,)), np.zeros((2,)), "logical_to_physical.shape"),
        (np.zeros((2, 2)), np.zeros((2, 1)), "replica_count.shape"),
        (np.zeros((2, 2)), np.zeros((3,)), "replica_count.shape"),
        (np.zeros((2, 2)), np.array([1, 3]), "replica_count"),
    ],
)
def test_bad_inputs(l2p, count, field):
    with pytest.raises(PlacementError) as info:
        build_expert_replica_routing_table(l2p, count, ep_rank=0)
    assert info.value.field == field
    if field != "replica_count":  # the device version checks shapes only (values stay on the device)
        with pytest.raises(PlacementError):
            compute_routing_table(torch.as_tensor(l2p), torch.as_tensor(count), 0)


@st.composite
def maps(draw):
    num_logical = draw(st.integers(1, 6))
    slots = num_logical + draw(st.integers(0, 6))
    extra = draw(st.lists(st.integers(0, num_logical - 1), min_size=slots - num_logical, max_size=slots - num_logical))
    placement = np.array([draw(st.permutations(list(range(num_logical)) + extra))])
    l2p, count = logical_maps(placement, num_logical, max_replicas=slots)
    return l2p[0], count[0], draw(st.integers(0, 15))


@settings(max_examples=60, deadline=None)
@given(maps())
def test_device_table_equals_reference_and_only_routes_to_replicas(case):
    l2p, count, rank = case
    ref = build_expert_replica_routing_table(l2p, count, rank, num_rows=64)
    dev = compute_routing_table(torch.from_numpy(l2p), torch.from_numpy(count), rank, num_rows=64)
    assert dev.dtype == torch.int32 and dev.numpy().tolist() == ref.tolist()
    for e in range(l2p.shape[0]):
        replicas = l2p[e, : count[e]]
        assert set(ref[:, e].tolist()) == set(replicas.tolist())  # every replica used, nothing else
        used = np.bincount(np.searchsorted(np.sort(replicas), ref[:, e]), minlength=len(replicas))
        assert used.max() - used.min() <= 1  # round robin


def _maps(placement, num_logical=4, width=3):
    l2p, count = logical_maps(np.array(placement), num_logical, max_replicas=width)
    return torch.from_numpy(l2p), torch.from_numpy(count)


def test_model_refresh_is_in_place_same_storage_and_address():
    l2p, count = _maps([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 2, 3]])
    tables = ModelRoutingTables(l2p, count, ep_rank=1)
    table, ptr = tables.table, tables.table.data_ptr()
    layer1 = tables.layer_view(1)
    new_l2p, new_count = _maps([[3, 1, 2, 0, 3, 3], [0, 1, 2, 3, 0, 0]])
    l2p.copy_(new_l2p)
    count.copy_(new_count)
    assert tables.refresh() is table
    assert table.data_ptr() == ptr and layer1.data_ptr() == table[1].data_ptr()
    assert table.untyped_storage().data_ptr() == ptr
    expected = compute_routing_table(new_l2p, new_count, 1)
    assert torch.equal(table, expected) and torch.equal(layer1, expected[1])


def test_single_layer_refresh_touches_only_that_layer():
    l2p, count = _maps([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]])
    tables = ModelRoutingTables(l2p, count, ep_rank=0)
    before = tables.table.clone()
    new_l2p, new_count = _maps([[0, 1, 2, 3, 2, 2], [0, 1, 2, 3, 3, 3]])
    l2p.copy_(new_l2p)
    count.copy_(new_count)
    ptr = tables.table.data_ptr()
    tables.refresh(layer=1)
    assert tables.table.data_ptr() == ptr
    assert torch.equal(tables.table[0], before[0])
    assert torch.equal(tables.table[1], compute_routing_table(new_l2p[1], new_count[1], 0))
    with pytest.raises(PlacementError, match="layer"):
        tables.refresh(layer=2)


def test_refresh_with_mismatched_maps_leaves_the_table_untouched():
    l2p, count = _maps([[0, 1, 2, 3]])
    table = compute_routing_table(l2p, count, 0)
    before = table.clone()
    wrong_l2p, wrong_count = _maps([[0, 1, 2, 3, 4, 4]], num_logical=5)
    with pytest.raises(PlacementError, match=r"routing_table\.shape"):
        refresh_expert_replica_routing_table(table, wrong_l2p, wrong_count, 0)
    assert torch.equal(table, before)


def test_refresh_or_build_keeps_identity_when_shape_fits():
    l2p, count = _maps([[0, 1, 2, 3]])
    first = torch.full((EXPERT_REPLICA_ROUTING_TABLE_NUM_ROWS, 4), -1, dtype=torch.int32)
    assert refresh_or_build(first, l2p[0], count[0], 0) is first
    assert torch.equal(first, compute_routing_table(l2p[0], count[0], 0))
    other = refresh_or_build(torch.zeros(2, 2, dtype=torch.int32), l2p[0], count[0], 0)
    assert other.shape == first.shape
