"""The vLLM adapter against the pinned vLLM's real EPLB classes (marked vllm; run in .nox/vllm)."""

import dataclasses
import inspect

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

import vllm_ranks  # noqa: E402  (next to this file: conftest puts the folder on sys.path)
from vllm.distributed.eplb import eplb_state as vllm_eplb_state  # noqa: E402
from vllm.distributed.eplb.eplb_communicator import EplbCommunicator, create_eplb_communicator  # noqa: E402
from vllm.distributed.eplb.eplb_state import EplbLayerState, EplbState  # noqa: E402

from ascend_dist.common.errors import TransferError  # noqa: E402
from ascend_dist.eplb_ascend._demo.launch import run_ranks  # noqa: E402
from ascend_dist.eplb_ascend.errors import EplbContractError, EplbStateError  # noqa: E402
from ascend_dist.eplb_ascend.state import MappingContract, detect_mapping_contract  # noqa: E402
from ascend_dist.eplb_ascend.tables import compute_routing_table  # noqa: E402
from ascend_dist.eplb_ascend.vllm_eplb import (  # noqa: E402
    AscendEplbCommunicator,
    AscendEplbLayerState,
    AscendEplbState,
    wrap_communicator_factory,
    wrap_move_to_workspace,
)


def test_two_ranks_through_vllm_eplb_state_gate_weights_and_tables():
    seen = run_ranks(vllm_ranks.run, {}, world=2, timeout_s=60)
    for s in seen:
        assert s["is_ascend"] == "AscendEplbState" and s["ep_size"] == 2
        assert s["tables_built"] and s["skipped_without_load"] and s["fresh_anywhere"]
        assert s["weights_moved"] and s["maps_in_place"] and s["tables_in_place"] and s["tables_match_maps"]
        assert s["profile_skips_reservation"]


def test_classes_subclass_vllm():
    assert issubclass(AscendEplbState, EplbState) and issubclass(AscendEplbLayerState, EplbLayerState)
    assert issubclass(AscendEplbCommunicator, EplbCommunicator)
    assert detect_mapping_contract(EplbState.from_mapping) is MappingContract.EXPANDED  # vLLM 0.33's contract


def _maps(rows):
    l2p = torch.tensor([[[0, 4, -1], [1, 5, -1], [2, -1, -1], [3, -1, -1]]] * rows)
    return l2p, torch.tensor([[2, 2, 1, 1]] * rows)


def test_layer_state_refresh_keeps_the_table_object():
    l2p, count = _maps(2)
    state = AscendEplbLayerState(ep_rank=1)
    state.set_layer_state(1, torch.zeros(2, 6), l2p, count)
    table = state.expert_replica_routing_table
    assert table is not None and torch.equal(table, compute_routing_table(l2p[1], count[1], 1))
    ptr = table.data_ptr()
    l2p[1, 0] = torch.tensor([4, 0, -1])  # vLLM commits maps in place; the layer holds row views
    state.refresh_expert_replica_routing_table()
    assert state.expert_replica_routing_table is table and table.data_ptr() == ptr
    assert torch.equal(table, compute_routing_table(l2p[1], count[1], 1))


def test_layer_state_from_upstream_and_uninitialized_refresh():
    l2p, count = _maps(1)
    upstream = EplbLayerState()
    upstream.set_layer_state(0, torch.zeros(1, 6), l2p, count)
    ours = AscendEplbLayerState.from_upstream(upstream)
    for f in dataclasses.fields(EplbLayerState):
        assert getattr(ours, f.name) is getattr(upstream, f.name)
    with pytest.raises(EplbStateError, match="before Ascend EPLB layer state is initialized"):
        AscendEplbLayerState(ep_rank=0).refresh_expert_replica_routing_table()


class FailingTransport:
    rank, world_size = 0, 2

    def __init__(self):
        self.batches = []

    def batch_send_recv(self, ops, timeout_s):
        self.batches.append(list(ops))
        raise TransferError("transfer failed")

    def all_gather_int64(self, values, timeout_s):
        raise AssertionError("unused")


def test_communicator_queues_tensors_as_is_and_clears_on_failure():
    transport = FailingTransport()
    comm = AscendEplbCommunicator(transport)
    assert comm.needs_profile_buffer_reservation is False
    t, r = torch.ones(4), torch.empty(4)
    comm.add_send([t], dst_rank=1, expert_id=3)
    comm.add_recv([r], src_rank=1, expert_id=3)
    with pytest.raises(TransferError, match="transfer failed"):
        comm.execute()
    sent, received = transport.batches[0]
    assert sent.tensor is t and received.tensor is r and sent.tag == received.tag == 3
    assert sent.tensor.storage_offset() == 0 and received.tensor.storage_offset() == 0
    comm.execute()  # the queue was cleared: nothing to run
    assert len(transport.batches) == 1
    with pytest.raises(ValueError, match="storage_offset"):
        comm.add_send([torch.ones(2, 4)[1]], dst_rank=1, expert_id=0)


def test_async_commit_wrapper_refreshes_the_committed_layer_only():
    refreshed = []

    class LayerState:
        def __init__(self, i):
            self.i = i

        def refresh_expert_replica_routing_table(self):
            refreshed.append(self.i)

    class Layer:
        def __init__(self, i):
            self.eplb_state = LayerState(i)

    class Pending:
        layer_idx = 1

    class ModelState:
        model = type("M", (), {"moe_layers": [Layer(0), Layer(1), Layer(2)]})()
        pending_result = Pending()

    def move(model_state, ep_rank):  # the original clears pending_result, like vLLM's
        model_state.pending_result = None

    wrapped = wrap_move_to_workspace(move)
    wrapped(model_state=ModelState(), ep_rank=0)
    assert refreshed == [1] and wrap_move_to_workspace(wrapped) is wrapped
    # The real vLLM function has the contract the wrapper needs (unwrapped: in a process where vLLM
    # already loaded our plugin, its start-up hook has wrapped it).
    real = inspect.unwrap(vllm_eplb_state._move_to_workspace)
    assert wrap_move_to_workspace(real) is not real
    with pytest.raises(EplbContractError, match="async workspace move"):
        wrap_move_to_workspace(lambda state, rank: None)


def test_communicator_factory_wrapper_against_vllm_signature():
    ours = AscendEplbCommunicator(FailingTransport())
    wrapped = wrap_communicator_factory(create_eplb_communicator, lambda coordinator, weights: ours)
    assert inspect.signature(wrapped) == inspect.signature(create_eplb_communicator)
    assert wrapped(group_coordinator=object(), backend="torch_nccl", expert_weights=[], expert_buffer=[]) is ours
    with pytest.raises(EplbContractError, match="factory signature"):
        wrap_communicator_factory(lambda group, backend: None, lambda c, w: None)


@pytest.mark.parametrize(("choice", "cls"), [("hccl", "HcclEplbCommunicator"),
                                             ("vllm", "TorchDistGlooStagedEplbCommunicator")])  # fmt: skip
def test_installed_hooks_make_vllms_own_factory_return_the_hccl_communicator(choice, cls):
    """Issue 25 item 6: the HCCL-backed communicator was a class no vLLM code path could pick."""
    seen = run_ranks(vllm_ranks.run_installed, {"choice": choice}, world=2, timeout_s=90)
    for s in seen:
        assert s["class"] == cls, s  # control: "vllm" leaves vLLM's own choice in place
        # Both factory references and the async commit are hooked (by this install, or already by
        # the plugin's start-up hook when vLLM loaded our plugin earlier in the process), once only.
        assert len(s["hooked"]) == 3 and set(s["installed"]) <= set(s["hooked"]) and s["again"] == [], s
        if choice == "hccl":
            assert s["engine"] == "gloo"  # the PyHcclCommunicator's CPU engine
            assert s["weights_moved"], s  # vLLM's own rearrangement moved experts across ranks through it


def test_communicator_choice_is_typed():
    from ascend_dist.common.errors import ConfigError
    from ascend_dist.eplb_ascend.vllm_install import communicator_choice

    assert communicator_choice({}) == "auto"
    assert communicator_choice({"ASCEND_DIST_EPLB_COMMUNICATOR": " HCCL "}) == "hccl"
    with pytest.raises(ConfigError, match="ASCEND_DIST_EPLB_COMMUNICATOR"):
        communicator_choice({"ASCEND_DIST_EPLB_COMMUNICATOR": "nccl"})
