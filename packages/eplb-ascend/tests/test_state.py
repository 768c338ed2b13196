"""vLLM-free state behaviour: the fresh-load gate, mapping-contract detection, table refresh walk."""

import pytest
import torch

from ascend_dist.eplb_ascend.errors import EplbContractError
from ascend_dist.eplb_ascend.state import (
    FreshLoadGate,
    MappingContract,
    detect_mapping_contract,
    mapping_arguments,
    refresh_model_routing_tables,
)


def from_mapping_033(cls, model, *, model_config, device, parallel_config, expanded_physical_to_logical): ...


def from_mapping_027(
    cls, model, *, model_config, device, parallel_config, expanded_physical_to_logical, num_valid_physical_experts
): ...


def from_mapping_renamed(cls, model, *, model_config, device, parallel_config, physical_to_logical): ...


def from_mapping_extra(
    cls, model, *, model_config, device, parallel_config, expanded_physical_to_logical, new_thing
): ...


def test_contract_is_read_from_the_signature():
    assert detect_mapping_contract(from_mapping_033) is MappingContract.EXPANDED
    assert detect_mapping_contract(from_mapping_027) is MappingContract.EXPANDED_WITH_VALID_COUNT
    with pytest.raises(EplbContractError, match="lacks"):
        detect_mapping_contract(from_mapping_renamed)
    with pytest.raises(EplbContractError, match="unknown"):
        detect_mapping_contract(from_mapping_extra)


def test_mapping_arguments_per_contract():
    mapping = torch.zeros(2, 6, dtype=torch.long)
    assert set(mapping_arguments(MappingContract.EXPANDED, mapping, 5)) == {"expanded_physical_to_logical"}
    args = mapping_arguments(MappingContract.EXPANDED_WITH_VALID_COUNT, mapping, None)
    assert args["num_valid_physical_experts"] == 6 and args["expanded_physical_to_logical"] is mapping
    assert mapping_arguments(MappingContract.EXPANDED_WITH_VALID_COUNT, mapping, 4)["num_valid_physical_experts"] == 4


class Coordinator:
    cpu_group = None
    device_group = None


def test_gate_records_only_real_steps_inside_the_window():
    gate = FreshLoadGate()
    gate.note_step(is_dummy=True, is_profile=False, should_record=True)
    gate.note_step(is_dummy=False, is_profile=True, should_record=True)
    gate.note_step(is_dummy=False, is_profile=False, should_record=False)
    assert not gate.any_rank_fresh(Coordinator())  # no group: the local flag decides
    gate.note_step(is_dummy=False, is_profile=False, should_record=True)
    assert gate.any_rank_fresh(Coordinator())
    gate.clear()
    assert not gate.fresh


def test_refresh_walk_skips_plain_layers_and_honours_layer_idx():
    refreshed = []

    class Refreshable:
        def __init__(self, i):
            self.i = i

        def refresh_expert_replica_routing_table(self):
            refreshed.append(self.i)

    class Layer:
        def __init__(self, state):
            self.eplb_state = state

    layers = [Layer(Refreshable(0)), Layer(object()), Layer(Refreshable(2)), object()]
    assert refresh_model_routing_tables(layers) == 2 and refreshed == [0, 2]
    assert refresh_model_routing_tables(layers, layer_idx=2) == 1 and refreshed == [0, 2, 2]
    assert refresh_model_routing_tables(layers, layer_idx=1) == 0
