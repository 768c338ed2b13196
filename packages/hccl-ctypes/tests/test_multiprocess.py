"""The binding and the communicator across real processes: the fake HCCL library and gloo."""

from __future__ import annotations

from typing import Any

import pytest


def _expected_comm(rank: int, world: int) -> dict[str, Any]:
    return {
        "sum": [float(world * i + sum(range(world))) for i in range(8)],
        "max": [float(i + world - 1) for i in range(8)],
        "inplace_bf16": [2.0 * world] * 4,
        "broadcast": [float(world - 1)] * 6,
        "all_gather": [[r, r] for r in range(world) for _ in range(2)],
        "reduce_scatter": [world * v for v in range(rank * 3, rank * 3 + 3)],
    }


def test_binding_over_fake_hccl_two_processes(fake_hccl: str, run_ranks: Any) -> None:
    results = run_ranks("binding", 2, {"FAKE_HCCL_LIB": fake_hccl})
    for rank, res in enumerate(results):
        assert res["allreduce_f32"] and res["allreduce_bf16"] and res["allreduce_i64"] and res["allreduce_f16"]
        assert res["broadcast"] == [1.0] * 5
        assert res["all_gather"] == [0, 0, 0, 1, 1, 1]
        # max over ranks of arange(4) * (r + 1): rank r keeps elements [2r, 2r + 2) of [0, 2, 4, 6]
        assert res["reduce_scatter_max"] == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)]
        assert res["p2p"] is True
        # upstream's names (hcclAllReduce, hcclBroadcast, hcclAllGather, the enums' from_torch) move the same bytes
        assert res["upstream_allreduce_max"] == [float(i * 2) for i in range(6)]
        assert res["upstream_broadcast"] == [1] * 4
        assert res["upstream_gather"] == [10, 10, 11, 11]
        assert res["count_overflow"].startswith("ConfigError::count=-1")
        assert res["bad_dtype_code"].startswith("UnsupportedDtype::datatype=99")
        assert res["int128"].startswith("HcclError:5:") and "E_NOT_SUPPORT" in res["int128"]
        assert res["double_destroy"].startswith("HcclError:2:HcclCommDestroy") and "E_PTR" in res["double_destroy"]
        assert res["use_after_destroy"].startswith("HcclError:2:")


def test_mismatched_world_size_fails_on_every_rank(fake_hccl: str, run_ranks: Any) -> None:
    results = run_ranks("mismatch", 2, {"FAKE_HCCL_LIB": fake_hccl, "HCCL_CONNECT_TIMEOUT": "10"})
    for res in results:
        assert res["init"].startswith("HcclError:1:HcclCommInitRootInfo") and "E_PARA" in res["init"]
        assert res["seconds"] < 5


@pytest.mark.parametrize(("backend", "world"), [("library", 2), ("gloo", 2), ("library", 3)])
def test_communicator_end_to_end(fake_hccl: str, run_ranks: Any, backend: str, world: int) -> None:
    env = {"COMM_BACKEND": backend, "HCCL_EXEC_TIMEOUT": "20"}
    if backend == "library":
        env["HCCL_SO_PATH"] = fake_hccl
    results = run_ranks("comm", world, env, timeout=60)
    for rank, res in enumerate(results):
        assert res["engine"] == backend
        for key, value in _expected_comm(rank, world).items():
            assert res[key] == value, (rank, key)
        if rank < 2:
            assert res["p2p"] == sum(range(1000))  # rank 1 received what rank 0 sent
        assert res["bad_dtype"].startswith("UnsupportedDtype::dtype=torch.bool")
        assert res["complex"].startswith("UnsupportedDtype::dtype=torch.complex64")
        assert res["non_contiguous"].startswith("ConfigError::in_tensor='a non-contiguous tensor")
        assert res["wrong_device"].startswith("ConfigError::in_tensor.device='meta'")
        assert res["bad_op"].startswith("UnsupportedOp::op=")
        assert res["bad_src"].startswith(f"ConfigError::src={world}")
        assert res["send_self"].startswith(f"ConfigError::dst={rank}")
        assert res["bad_out_size"].startswith("ConfigError::out_tensor=")
        assert res["rs_not_divisible"].startswith("ConfigError::in_tensor=")
        assert res["use_after_destroy"].startswith("CommunicatorClosed")
        assert res["double_destroy"] == "no error"
        disabled, available, reason = res["missing_lib"]
        assert disabled and not available and "/nonexistent/libhccl.so" in reason and "HCCL_SO_PATH" in reason
        assert res["missing_lib_call"].startswith("CommunicatorUnavailable::the communicator is disabled")


def test_scripted_library_errors_fail_construction_with_their_string(fake_hccl: str, run_ranks: Any) -> None:
    scripts = {
        "HcclCommInitRootInfo:11": "HcclError:11:HcclCommInitRootInfo failed with code 11: E_TCP_CONNECT",
        # the warm-up all-reduce fails on the stream: surfaces, typed, at its synchronize
        "HcclAllReduce:4": "HcclError:4:HcclAllReduce failed with code 4: E_INTERNAL",
    }
    env = {"HCCL_SO_PATH": fake_hccl, "FAKE_HCCL_SCRIPTS": ",".join(scripts)}
    for res in run_ranks("comm_errors", 2, env):
        for script, expected in scripts.items():
            assert res[script].startswith(expected)
        assert res["after"] == [2.0, 2.0, 2.0]  # failed constructions released everything; a new one works


def test_peer_that_never_joins_fails_construction_within_deadline(fake_hccl: str, run_ranks: Any) -> None:
    res = run_ranks("nojoin", 2, {"HCCL_SO_PATH": fake_hccl})[0]
    assert res["construct"].startswith("DeadlineExceeded")
    assert res["seconds"] < 6


def test_a_collective_the_peer_never_joins_fails_within_its_deadline(fake_hccl: str, run_ranks: Any) -> None:
    res = run_ranks("stall", 2, {"HCCL_SO_PATH": fake_hccl})[0]
    assert res["broadcast"].startswith("DeadlineExceeded"), res
    assert res["seconds"] < 4


def test_rebuilt_communicators_are_released_and_context_managed(fake_hccl: str, run_ranks: Any) -> None:
    for res in run_ranks("context", 2, {"HCCL_SO_PATH": fake_hccl}):
        assert res["sums"] == [[2.0, 2.0]] * 3
        assert res["closed"].startswith("CommunicatorClosed")


@pytest.mark.parametrize("backend", ["gloo", "library"])
def test_communicator_on_a_group_torch_distributed_never_registered(
    fake_hccl: str, run_ranks: Any, backend: str
) -> None:
    """``ProcessGroupGloo(PrefixStore(TCPStore))`` with no default group: ranks and collectives from the group."""
    env = {"COMM_BACKEND": backend, "HCCL_EXEC_TIMEOUT": "20"}
    if backend == "library":
        env["HCCL_SO_PATH"] = fake_hccl  # the root info travels on the unregistered group
    results = run_ranks("unregistered", 2, env, timeout=60)
    for rank, res in enumerate(results):
        assert (res["registered"], res["rank"], res["world"], res["engine"]) == (False, rank, 2, backend)
        for key, value in _expected_comm(rank, 2).items():
            assert res[key] == value, (rank, key)
        assert res["p2p"] == sum(range(1000))
        assert res["bad_src"].startswith("ConfigError::src=2")
        assert res["use_after_destroy"].startswith("CommunicatorClosed")


@pytest.mark.vllm
@pytest.mark.timeout(240)  # each rank imports vLLM (seconds each; minutes on a loaded 2-core VM)
@pytest.mark.parametrize(("backend", "world"), [("gloo", 2), ("library", 3)])
def test_communicator_on_vllms_stateless_process_group(
    fake_hccl: str, run_ranks: Any, backend: str, world: int
) -> None:
    """``PyHcclCommunicator(StatelessProcessGroup.create(...), device)`` with upstream's call shapes."""
    env = {"HCCL_EXEC_TIMEOUT": "20"}
    if backend == "library":
        env["HCCL_SO_PATH"] = fake_hccl  # the root info travels on a gloo group over the stateless group's store
    results = run_ranks("stateless", world, env, timeout=200)
    for rank, res in enumerate(results):
        assert (res["engine"], res["second_engine"], res["rank"], res["world"]) == (backend, backend, rank, world)
        assert res["sum"] == [float(world * i + sum(range(world))) for i in range(8)]
        assert res["max"] == [float(i + world - 1) for i in range(8)]
        assert res["min"] == [float(i) for i in range(8)]
        assert res["broadcast"] == [float(world - 1)] * 5
        assert res["second"] == [float(sum(range(1, world + 1)))] * 3
        assert res["group_is_callers"] is True
        assert res["untouched_x"] == [float(i + rank) for i in range(8)]  # all_reduce(x) returns a new tensor
        assert res["vllm_order"].startswith("UnsupportedOp::op=")
        assert res["after_close"].startswith("CommunicatorClosed")
        assert res["close_twice"] == "no error"


@pytest.mark.vllm
@pytest.mark.timeout(240)
def test_a_stateless_group_peer_that_never_builds_the_communicator_fails_within_its_deadline(run_ranks: Any) -> None:
    res = run_ranks("stateless_nojoin", 2, timeout=200)[0]
    assert res["init"].startswith("DeadlineExceeded"), res
    assert res["seconds"] < 15, res
