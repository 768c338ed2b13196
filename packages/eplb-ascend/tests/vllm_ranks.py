"""One rank of the vLLM adapter test (imported by test_vllm_adapter.py after its vLLM check, run in forked children).

Brings up vLLM's own distributed environment over gloo on the CPU with EPLB enabled (set after
the config is built: on CPU vLLM's config check refuses EPLB, the Ascend platform lifts that),
builds a synthetic MoE model whose layers carry `AscendEplbLayerState`, and drives the real
`EplbState.from_mapping`, the fresh-load gate over vLLM's EP group, and vLLM's own
`rearrange_expert_weights_inplace` with our communicator, then vLLM's in-place map commit.
"""

import os

import torch
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.config.parallel import EPLBConfig
from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
from vllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    ensure_model_parallel_initialized,
    get_ep_group,
    get_eplb_group,
    init_distributed_environment,
)

from ascend_dist.eplb_ascend.state import refresh_model_routing_tables
from ascend_dist.eplb_ascend.tables import compute_routing_table
from ascend_dist.eplb_ascend.vllm_eplb import AscendEplbCommunicator, AscendEplbLayerState, AscendEplbState

LAYERS, LOGICAL, PHYSICAL = 2, 4, 6


class Layer:
    def __init__(self):
        self.eplb_state = AscendEplbLayerState()


class SyntheticMoE:
    """The attributes vLLM's EplbState reads from a MixtureOfExperts model."""

    def __init__(self, world, rank, placement):
        self.num_moe_layers, self.num_logical_experts, self.num_routed_experts = LAYERS, LOGICAL, LOGICAL
        self.num_physical_experts, self.num_redundant_experts = PHYSICAL, PHYSICAL - LOGICAL
        self.num_expert_groups, self.num_shared_experts = 1, 0
        self.num_local_physical_experts = PHYSICAL // world
        self.moe_layers = [Layer() for _ in range(LAYERS)]
        per = PHYSICAL // world
        mine = [row[rank * per : (rank + 1) * per] for row in placement]
        self.expert_weights = [
            [
                torch.stack([torch.full((4,), float(100 * layer + e)) for e in mine[layer]]),
                torch.stack([torch.full((3, 2), float(-100 * layer - e)) for e in mine[layer]]),
            ]
            for layer in range(LAYERS)
        ]

    def set_eplb_state(self, load, l2p, count):
        for i, layer in enumerate(self.moe_layers):
            layer.eplb_state.set_layer_state(i, load, l2p, count)


class ModelConfig:
    model = "synthetic-moe"

    def compute_hash(self):
        return "synthetic-moe"


def weights_ok(model, placement, rank, world):
    per = PHYSICAL // world
    for layer in range(LAYERS):
        for row, e in enumerate(placement[layer][rank * per : (rank + 1) * per]):
            w1, w2 = model.expert_weights[layer][0][row], model.expert_weights[layer][1][row]
            if not (bool((w1 == 100 * layer + e).all()) and bool((w2 == -100 * layer - e).all())):
                return False
    return True


def tables_match(model_state, tables, rank):
    l2p, count = model_state.logical_to_physical_map, model_state.logical_replica_count
    return all(torch.equal(t, compute_routing_table(l2p[i], count[i], rank)) for i, t in enumerate(tables))


def run(cfg):
    rank, world = cfg["rank"], cfg["world"]
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world), device_config=DeviceConfig("cpu"))
    parallel = config.parallel_config
    parallel.enable_eplb = True
    parallel.eplb_config = EPLBConfig(window_size=2, step_interval=4, use_async=False, communicator="torch_gloo")
    # vLLM's CPU worker names the ranks' shared-memory group before creating its groups; its CPU
    # communicator needs the name whenever vLLM's C ops are loaded (a forked rank inherits them when
    # an earlier test in the parent loaded them), so set it as the CPU worker does: the init port
    os.environ["VLLM_DIST_IDENT"] = str(cfg["port"])
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{cfg['port']}")  # fmt: skip
        ensure_model_parallel_initialized(world, 1, backend="gloo")
        try:
            return _scenario(rank, world, parallel)
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()


def _scenario(rank, world, parallel):
    old = [[0, 1, 2, 3, 0, 1]] * LAYERS
    model = SyntheticMoE(world, rank, old)
    state = AscendEplbState.from_mapping(model, ModelConfig(), torch.device("cpu"), parallel, torch.tensor(old))
    model_state = next(iter(state.model_states.values()))
    tables = [layer.eplb_state.expert_replica_routing_table for layer in model.moe_layers]
    ptrs = [t.data_ptr() for t in tables]
    out = {"rank": rank, "is_ascend": type(state).__name__, "ep_size": get_ep_group().world_size}
    out["tables_built"] = tables_match(model_state, tables, rank)
    communicator = AscendEplbCommunicator.over_cpu_group(get_eplb_group(), require_standalone=False, timeout_s=20)
    state.update_communicator(ModelConfig(), communicator)
    # No rank recorded load: the collective decision skips the rebalance on every rank.
    out["skipped_without_load"] = state.rearrange() is None
    # Only rank 0 records load: every rank learns "fresh somewhere".
    state._fresh_gate.note_step(is_dummy=False, is_profile=False, should_record=rank == 0)
    out["fresh_anywhere"] = state.has_global_fresh_recorded_load()
    # vLLM's own weight movement with our communicator, its commit, then our refresh (rearrange's sync tail).
    new = [[3, 3, 2, 0, 1, 3], [1, 0, 3, 2, 2, 0]]
    rearrange_expert_weights_inplace(
        model_state.physical_to_logical_map, torch.tensor(new), model.expert_weights, model_state.expert_buffer,
        get_eplb_group().device_group, communicator,
    )  # fmt: skip
    l2p_ptr = model_state.logical_to_physical_map.data_ptr()
    state.update_mapping(ModelConfig(), torch.tensor(new))  # vLLM's in-place commit (no pinned memory on CPU)
    out["maps_in_place"] = model_state.logical_to_physical_map.data_ptr() == l2p_ptr
    refresh_model_routing_tables(model.moe_layers)
    out["weights_moved"] = weights_ok(model, new, rank, world)
    now = [layer.eplb_state.expert_replica_routing_table for layer in model.moe_layers]
    out["tables_in_place"] = all(a is b and a.data_ptr() == p for a, b, p in zip(now, tables, ptrs, strict=True))
    out["tables_match_maps"] = tables_match(model_state, now, rank)
    out["profile_skips_reservation"] = not communicator.needs_profile_buffer_reservation
    return out


def run_installed(cfg):
    """`vllm_install.install()`, then vLLM's own ``create_eplb_communicator`` call as `EplbState` makes it."""
    rank, world = cfg["rank"], cfg["world"]
    os.environ["ASCEND_DIST_EPLB_COMMUNICATOR"] = cfg["choice"]
    config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world), device_config=DeviceConfig("cpu"))
    config.parallel_config.enable_eplb = True  # after the config check, as in `run`
    config.parallel_config.eplb_config = EPLBConfig(use_async=False, communicator="torch_gloo")
    os.environ["VLLM_DIST_IDENT"] = str(cfg["port"])
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{cfg['port']}")  # fmt: skip
        ensure_model_parallel_initialized(world, 1, backend="gloo")
        try:
            from vllm.distributed.eplb import eplb_state

            from ascend_dist.eplb_ascend.vllm_install import install

            out = {"rank": rank, "installed": install(), "again": install()}
            from vllm.distributed.eplb import eplb_communicator

            targets = {
                f"{eplb_communicator.__name__}.create_eplb_communicator": eplb_communicator.create_eplb_communicator,
                f"{eplb_state.__name__}.create_eplb_communicator": eplb_state.create_eplb_communicator,
                f"{eplb_state.__name__}._move_to_workspace": eplb_state._move_to_workspace,
            }
            out["hooked"] = sorted(k for k, fn in targets.items() if getattr(fn, "__ascend_dist_wrapped__", False))
            old, new = [[0, 1, 2, 3, 0, 1]] * LAYERS, [[3, 3, 2, 0, 1, 3], [1, 0, 3, 2, 2, 0]]
            model = SyntheticMoE(world, rank, old)
            buffer = [torch.empty_like(w) for w in model.expert_weights[0]]
            communicator = eplb_state.create_eplb_communicator(
                group_coordinator=get_eplb_group(), backend="torch_gloo", expert_weights=model.expert_weights,
                expert_buffer=buffer,
            )  # fmt: skip
            out["class"] = type(communicator).__name__
            out["engine"] = getattr(getattr(communicator, "communicator", None), "engine", None)
            if cfg["choice"] == "vllm":
                return out  # vLLM's own staged gloo communicator records CUDA events: not on this host
            rearrange_expert_weights_inplace(
                torch.tensor(old), torch.tensor(new), model.expert_weights, buffer, get_eplb_group().device_group,
                communicator,
            )  # fmt: skip
            out["weights_moved"] = weights_ok(model, new, rank, world)
            return out
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
