"""Small pure pieces: worker ranks, the session table, device identity, handle merge and pick."""

from __future__ import annotations

import pytest
import torch

from ascend_dist.common.device.ipc import IPC_HANDLE_VERSION, IpcHandle
from ascend_dist.common.errors import ConfigError, ProtocolError
from ascend_dist.weight_transfer.errors import ManifestMismatch, UpdateStateError
from ascend_dist.weight_transfer.ipc import device_uuid, merge_handles, pick_handle
from ascend_dist.weight_transfer.messages import make_manifest
from ascend_dist.weight_transfer.session import ModuleSink, Session, SessionState
from ascend_dist.weight_transfer.worker import worker_group_rank


@pytest.mark.parametrize(
    ("offset", "dp", "replica", "rank", "expected"),
    [(1, 0, 1, 0, 1), (1, 1, 1, 0, 2), (1, 0, 4, 3, 4), (1, 2, 4, 1, 10), (3, 1, 2, 1, 6)],
)
def test_worker_group_rank(offset: int, dp: int, replica: int, rank: int, expected: int) -> None:
    assert worker_group_rank(offset, dp, replica, rank) == expected


@pytest.mark.parametrize(
    ("args", "field"),
    [((1, 0, 2, 2), "rank_in_replica"), ((1, -1, 2, 0), "data_parallel_index"), ((0, 0, 1, 0), "rank_offset"),
     ((1, 0, 0, 0), "replica_world_size")],
)  # fmt: skip
def test_worker_group_rank_refuses_bad_input(args: tuple[int, int, int, int], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        worker_group_rank(*args)


def test_session_transitions_and_hints() -> None:
    s = Session("engine")
    with pytest.raises(UpdateStateError, match="init_transfer_engine first"):
        s.require("start")
    s.require("init")
    s.move(SessionState.READY)
    with pytest.raises(UpdateStateError, match="start_weight_update first"):
        s.require("update")
    s.require("start")
    s.move(SessionState.ACTIVE)
    with pytest.raises(UpdateStateError, match="finish_weight_update first"):
        s.require("start")
    s.move(SessionState.CLOSED)
    with pytest.raises(UpdateStateError, match="shut down"):
        s.require("init")


def test_module_sink_validates_before_writing() -> None:
    model = torch.nn.Linear(3, 2)
    sink = ModuleSink(model)
    sink.validate(make_manifest([("weight", "float32", (2, 3)), ("bias", "float32", (2,))]))
    with pytest.raises(ManifestMismatch, match="unknown parameter 'nope'"):
        sink.validate(make_manifest([("nope", "float32", (2,))]))
    with pytest.raises(ManifestMismatch, match=r"shape of 'bias': model has \(2,\), update has \(3,\)"):
        sink.validate(make_manifest([("bias", "float32", (3,))]))
    with pytest.raises(ManifestMismatch, match="dtype of 'bias': model has float32, update has bfloat16"):
        sink.validate(make_manifest([("bias", "bfloat16", (2,))]))
    assert sink.load_weights([("bias", torch.ones(2))]) == {"bias"}
    assert torch.equal(model.bias.detach(), torch.ones(2))


def test_device_uuid_uses_the_visible_devices_list() -> None:
    assert device_uuid(1, "npu", ip="10.0.0.1", visible="4, 6,7") == "10.0.0.1-6"
    assert device_uuid(2, "cuda", ip="10.0.0.1", visible="") == "10.0.0.1-2"
    assert device_uuid(0, "cpu", ip="h") == "h-cpu0"
    with pytest.raises(ConfigError, match="logical device index"):
        device_uuid(3, "npu", ip="h", visible="0,1")


def _handle(name: bytes, index: int = 0) -> IpcHandle:
    return IpcHandle(version=IPC_HANDLE_VERSION, backend="npu", payload=name, offset=0, nbytes=8, dtype="uint8",
                     shape=(8,), stride=(1,), device_index=index)  # fmt: skip


def test_merge_handles_unions_per_entry_and_refuses_conflicts() -> None:
    rank0 = [{"h-0": _handle(b"a0")}, {"h-0": _handle(b"b0")}]
    rank1 = [{"h-1": _handle(b"a1")}, {"h-1": _handle(b"b1")}]
    merged = merge_handles([rank0, rank1])
    assert merged == [{"h-0": _handle(b"a0"), "h-1": _handle(b"a1")}, {"h-0": _handle(b"b0"), "h-1": _handle(b"b1")}]
    with pytest.raises(ConfigError, match="h-0"):
        merge_handles([rank0, rank0])
    with pytest.raises(ProtocolError, match="rank 1 exported 1"):
        merge_handles([rank0, rank1[:1]])


def test_pick_handle_rewrites_the_device_index() -> None:
    picked = pick_handle({"h-5": _handle(b"x", index=7)}, "h-5", 0)
    assert picked.device_index == 0 and picked.payload == b"x"
    with pytest.raises(ConfigError, match=r"one of \['h-5'\]"):
        pick_handle({"h-5": _handle(b"x")}, "h-4", 0)


def test_unknown_names_follows_vllms_renaming_rules() -> None:
    from ascend_dist.weight_transfer.model_names import unknown_names

    class PPMissingLayer(torch.nn.Module):  # vLLM's placeholder for another pipeline stage's layer
        pass

    class Mapper:  # the part of vLLM's WeightsMapper the check uses
        def apply_list(self, names: list[str]) -> list[str]:
            return [n.replace("visual.", "vision.") for n in names if not n.startswith("dropped.")]

    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.qkv_proj = torch.nn.Linear(2, 6)
    model.mlp = torch.nn.Module()
    model.mlp.experts = torch.nn.Module()
    model.mlp.experts.register_parameter("w13_weight", torch.nn.Parameter(torch.zeros(1)))
    model.vision = torch.nn.Linear(2, 2)
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), PPMissingLayer()])
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    model.hf_to_vllm_mapper = Mapper()
    good = [
        "attn.qkv_proj.weight",  # directly
        "attn.q_proj.weight",  # packed
        "attn.v_proj.bias",
        "visual.weight",  # through the mapper
        "dropped.anything",  # the mapper drops it
        "mlp.experts.3.gate_proj.weight",  # fused experts
        "layers.0.weight",
        "layers.1.weight",  # another pipeline stage's layer
        "attn.rotary_emb.inv_freq",  # skipped by vLLM's loaders
    ]
    assert unknown_names(model, good) == []
    bad = ["attn.q_prj.weight", "layers.0.wieght", "mlp.expert.0.w", "layers.2.weight", "lm_head.weight"]
    assert unknown_names(model, [*good, *bad]) == bad


def test_shape_and_dtype_mismatches_follow_vllms_loaders() -> None:
    """Issue 25 item 4: only names were checked before the vote; a wrong shape failed inside vLLM's loader."""
    from ascend_dist.weight_transfer.model_names import mismatches

    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.register_parameter("weight", torch.nn.Parameter(torch.zeros(8)))  # default loader: exact shape
    model.qkv_proj = torch.nn.Module()
    qkv = torch.nn.Parameter(torch.zeros(12, 16))  # fused and TP-sharded along dim 0 (vLLM's ``output_dim``)
    qkv.output_dim = 0  # pyright: ignore[reportAttributeAccessIssue]
    model.qkv_proj.register_parameter("weight", qkv)
    model.conv = torch.nn.Module()
    conv = torch.nn.Parameter(torch.zeros(4, 3))
    conv.weight_loader = lambda p, w: p.copy_(w.squeeze(1))  # pyright: ignore[reportAttributeAccessIssue]
    model.conv.register_parameter("weight", conv)  # a loader of its own reshapes: not checked
    model.scale = torch.nn.Module()
    model.scale.register_parameter("weight", torch.nn.Parameter(torch.zeros(()), requires_grad=False))
    model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    good = [
        ("norm.weight", "bfloat16", (8,)),  # another float dtype: vLLM's loaders cast
        ("q_proj.weight", "bfloat16", (64, 16)),  # the sharded dim is the trainer's full size
        ("qkv_proj.weight", "float32", (36, 16)),
        ("conv.weight", "float32", (4, 1, 3)),
        ("scale.weight", "float32", (1,)),  # one element into a 0-dim parameter
        ("unknown.weight", "float32", (3,)),  # names are unknown_names' job
    ]
    assert mismatches(model, good) == []
    bad = [
        ("norm.weight", "float32", (9,)),
        ("k_proj.weight", "float32", (64, 17)),  # the unsharded dim differs
        ("v_proj.weight", "float32", (64,)),  # rank differs
        ("norm.weight", "int8", (8,)),  # an integer tensor into a float parameter
    ]
    found = mismatches(model, [*good, *bad])
    assert len(found) == 4, found
    assert "'norm.weight'" in found[0] and "(9,)" in found[0] and "(8,)" in found[0]
    assert "'k_proj.weight'" in found[1] and "dim 1" in found[1]
    assert "'v_proj.weight'" in found[2] and "dims" in found[2]
    assert "'norm.weight'" in found[3] and "int8" in found[3]


def test_an_emptied_weight_is_left_to_its_loader() -> None:
    """vLLM's CPU build packs a linear weight into a GEMM handle after loading and leaves ``(0,)``:
    that is no shape to check against (the engine tier's every update was refused as "(0,)")."""
    from ascend_dist.weight_transfer.model_names import mismatches

    model = torch.nn.Module()
    model.down_proj = torch.nn.Module()
    emptied = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    emptied.input_dim = 1  # pyright: ignore[reportAttributeAccessIssue]
    emptied.output_dim = 0  # pyright: ignore[reportAttributeAccessIssue]
    model.down_proj.register_parameter("weight", emptied)
    assert mismatches(model, [("down_proj.weight", "float32", (128, 256))]) == []
