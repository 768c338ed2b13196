"""One rank of a multi-process test: `python rank_worker.py SCENARIO RANK WORLD PORT`.

Joins a gloo group on 127.0.0.1:PORT, runs SCENARIO and prints one line ``RESULT <json>`` with what
it observed (values and error types); the test compares the ranks' results. The fake HCCL library's
path comes from HCCL_SO_PATH (or FAKE_HCCL_LIB for the raw-binding scenarios).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ascend_dist.common.device import create_runtime
from ascend_dist.hccl_ctypes import HCCLLibrary, aclrtStream_t, buffer_type, hcclDataTypeEnum, hcclRedOpTypeEnum
from ascend_dist.hccl_ctypes.communicator import PyHcclCommunicator


def _err(fn: Callable[[], object]) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}:{getattr(exc, 'code', '')}:{exc}"
    return "no error"


def scenario_binding(rank: int, world: int) -> dict[str, Any]:
    lib = HCCLLibrary(os.environ["FAKE_HCCL_LIB"])
    uid = lib.get_unique_id() if rank == 0 else lib.dialect.id_type()
    raw = torch.frombuffer(bytearray(bytes(uid)), dtype=torch.uint8)
    dist.broadcast(raw, 0)
    comm = lib.comm_init_rank(world, lib.unique_id_from_bytes(raw.numpy().tobytes()), rank)
    out: dict[str, Any] = {}
    for name, dtype, code in (("f32", torch.float32, 4), ("bf16", torch.bfloat16, 11), ("i64", torch.int64, 5),
                              ("f16", torch.float16, 3)):  # fmt: skip
        x = torch.arange(3 * 1024 * 1024 // 4 if name == "f32" else 1000).to(dtype) + rank
        y = torch.empty_like(x)
        lib.all_reduce(x.data_ptr(), y.data_ptr(), x.numel(), code, 0, comm, None)
        expected = sum(torch.arange(x.numel()).to(dtype) + r for r in range(world))
        out[f"allreduce_{name}"] = bool(torch.equal(y, expected))
    b = torch.full((5,), float(rank))
    lib.broadcast(b.data_ptr(), 5, 4, world - 1, comm, None)
    out["broadcast"] = b.tolist()
    g = torch.empty(world * 3, dtype=torch.int32)
    mine = torch.full((3,), rank, dtype=torch.int32)  # keep a reference: the C call reads its memory
    lib.all_gather(mine.data_ptr(), g.data_ptr(), 3, 2, comm, None)
    out["all_gather"] = g.tolist()
    rs = torch.empty(2, dtype=torch.float64)
    full = torch.arange(2 * world, dtype=torch.float64) * (rank + 1)
    lib.reduce_scatter(full.data_ptr(), rs.data_ptr(), 2, 10, 2, comm, None)
    out["reduce_scatter_max"] = rs.tolist()
    msg = torch.arange(300_000, dtype=torch.int32) * (rank + 1)
    got = torch.empty_like(msg)
    dst, src = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        lib.send(msg.data_ptr(), msg.numel(), 2, dst, comm, None)
        lib.recv(got.data_ptr(), got.numel(), 2, src, comm, None)
    else:
        lib.recv(got.data_ptr(), got.numel(), 2, src, comm, None)
        lib.send(msg.data_ptr(), msg.numel(), 2, dst, comm, None)
    out["p2p"] = bool(torch.equal(got, torch.arange(300_000, dtype=torch.int32) * (src + 1)))
    out.update(_upstream_names(lib, comm, rank, world))
    out["count_overflow"] = _err(lambda: lib.all_reduce(y.data_ptr(), y.data_ptr(), -1, 4, 0, comm, None))
    out["bad_dtype_code"] = _err(lambda: lib.all_reduce(y.data_ptr(), y.data_ptr(), 1, 99, 0, comm, None))
    out["int128"] = _err(lambda: lib.all_reduce(y.data_ptr(), y.data_ptr(), 1, 12, 0, comm, None))
    lib.comm_destroy(comm)
    out["double_destroy"] = _err(lambda: lib.comm_destroy(comm))
    out["use_after_destroy"] = _err(lambda: lib.all_reduce(y.data_ptr(), y.data_ptr(), 1, 4, 0, comm, None))
    return out


def _upstream_names(lib: HCCLLibrary, comm: Any, rank: int, world: int) -> dict[str, Any]:
    """The calls as code written against vllm-ascend's pyhccl_wrapper makes them (ctypes buffers, enums)."""
    stream = aclrtStream_t(None)  # upstream: aclrtStream_t(torch.npu.current_stream().npu_stream)
    x = torch.arange(6, dtype=torch.bfloat16) * (rank + 1)
    y = torch.zeros_like(x)
    lib.hcclAllReduce(buffer_type(x.data_ptr()), buffer_type(y.data_ptr()), x.numel(),
                      hcclDataTypeEnum.from_torch(x.dtype), hcclRedOpTypeEnum.from_torch(dist.ReduceOp.MAX), comm,
                      stream)  # fmt: skip
    b = torch.full((4,), rank, dtype=torch.int64)
    code = hcclDataTypeEnum.from_torch(b.dtype)
    lib.hcclBroadcast(buffer_type(b.data_ptr()), b.numel(), code, world - 1, comm, stream)
    g = torch.zeros(world * 2, dtype=torch.int32)
    mine = torch.full((2,), rank + 10, dtype=torch.int32)
    lib.hcclAllGather(buffer_type(mine.data_ptr()), buffer_type(g.data_ptr()), 2, hcclDataTypeEnum.hcclInt32, comm,
                      stream)  # fmt: skip
    return {"upstream_allreduce_max": y.float().tolist(), "upstream_broadcast": b.tolist(),
            "upstream_gather": g.tolist()}  # fmt: skip


def scenario_mismatch(rank: int, world: int) -> dict[str, Any]:
    lib = HCCLLibrary(os.environ["FAKE_HCCL_LIB"])
    uid = lib.get_unique_id() if rank == 0 else lib.dialect.id_type()
    raw = torch.frombuffer(bytearray(bytes(uid)), dtype=torch.uint8)
    dist.broadcast(raw, 0)
    uid = lib.unique_id_from_bytes(raw.numpy().tobytes())
    claimed = world + (1 if rank == world - 1 else 0)  # the last rank believes in one more rank
    start = time.monotonic()
    error = _err(lambda: lib.comm_init_rank(claimed, uid, rank))
    return {"init": error, "seconds": time.monotonic() - start}


def _exercise(comm: PyHcclCommunicator, rank: int, world: int) -> dict[str, Any]:
    rt = comm.runtime
    out: dict[str, Any] = {"engine": comm.engine}
    x = torch.arange(8, dtype=torch.float32) + rank
    y = comm.all_reduce(x)
    m = comm.all_reduce(x.clone(), op=dist.ReduceOp.MAX)
    side = rt.new_stream()
    z = torch.full((4,), 2.0, dtype=torch.bfloat16)
    side.wait_stream(rt.current_stream())  # one communicator: its ops must be ordered across streams
    comm.all_reduce(z, stream=side, out_tensor=z)
    rt.current_stream().wait_stream(side)
    b = torch.full((6,), float(rank), dtype=torch.float64)
    comm.broadcast(b, src=world - 1)
    g = comm.all_gather(torch.full((2, 2), rank, dtype=torch.int64))
    rs = comm.reduce_scatter(torch.arange(world * 3, dtype=torch.int32))
    rt.current_stream().synchronize(30)
    side.synchronize(30)
    out.update(sum=y.tolist(), max=m.tolist(), inplace_bf16=z.float().tolist(), broadcast=b.tolist(),
               all_gather=g.tolist(), reduce_scatter=rs.tolist())  # fmt: skip
    if world >= 2 and rank < 2:
        t = torch.arange(1000, dtype=torch.int32) if rank == 0 else torch.zeros(1000, dtype=torch.int32)
        (comm.send(t, 1) if rank == 0 else comm.recv(t, 0))
        rt.current_stream().synchronize(30)
        out["p2p"] = int(t.sum())
    good = torch.ones(4)
    out["bad_dtype"] = _err(lambda: comm.all_reduce(torch.ones(4, dtype=torch.bool)))
    out["complex"] = _err(lambda: comm.all_reduce(torch.ones(4, dtype=torch.complex64)))
    out["non_contiguous"] = _err(lambda: comm.all_reduce(torch.ones(4, 4).t()))
    out["wrong_device"] = _err(lambda: comm.all_reduce(torch.ones(4, device="meta")))
    out["bad_op"] = _err(lambda: comm.all_reduce(good, op=dist.ReduceOp.AVG))
    out["bad_src"] = _err(lambda: comm.broadcast(good, src=world))
    out["send_self"] = _err(lambda: comm.send(good, rank))
    out["bad_out_size"] = _err(lambda: comm.all_gather(good, torch.empty(3)))
    out["rs_not_divisible"] = _err(lambda: comm.reduce_scatter(torch.ones(world * 2 + 1)))
    comm.destroy()
    out["use_after_destroy"] = _err(lambda: comm.all_reduce(good))
    out["double_destroy"] = _err(comm.destroy)
    return out


def scenario_comm(rank: int, world: int) -> dict[str, Any]:
    backend = os.environ.get("COMM_BACKEND", "auto")
    rt = create_runtime("cpu")
    try:
        comm = PyHcclCommunicator(dist.group.WORLD, backend=backend, runtime=rt, init_timeout_s=20)  # type: ignore[arg-type]
        out = _exercise(comm, rank, world)
        off = PyHcclCommunicator(dist.group.WORLD, "cpu", "/nonexistent/libhccl.so", backend="library", runtime=rt)  # type: ignore[arg-type]
        out["missing_lib"] = [off.disabled, off.available, off.disabled_reason]
        out["missing_lib_call"] = _err(lambda: off.all_reduce(torch.ones(2)))
        return out
    finally:
        rt.close()


def scenario_comm_errors(rank: int, world: int) -> dict[str, Any]:
    """FAKE_HCCL_SCRIPTS lists failures to script, one construction attempt each (same order on all ranks)."""
    rt = create_runtime("cpu")
    out: dict[str, Any] = {}
    try:
        for script in os.environ["FAKE_HCCL_SCRIPTS"].split(","):
            os.environ["FAKE_HCCL_FAIL"] = script  # the library reads it at call time
            out[script] = _err(lambda: PyHcclCommunicator(dist.group.WORLD, runtime=rt, init_timeout_s=10))  # type: ignore[arg-type]
        del os.environ["FAKE_HCCL_FAIL"]
        with PyHcclCommunicator(dist.group.WORLD, runtime=rt, init_timeout_s=10) as comm:  # type: ignore[arg-type]
            ok = comm.all_reduce(torch.ones(3))
            rt.current_stream().synchronize(30)
        out["after"] = ok.tolist()
        return out
    finally:
        rt.close()


def scenario_nojoin(rank: int, world: int) -> dict[str, Any]:
    rt = create_runtime("cpu")
    try:
        if rank != 0:
            time.sleep(4)  # present in the gloo group, never builds the communicator
            return {"skipped": True}
        start = time.monotonic()
        error = _err(lambda: PyHcclCommunicator(dist.group.WORLD, runtime=rt, init_timeout_s=2))  # type: ignore[arg-type]
        return {"construct": error, "seconds": time.monotonic() - start}
    finally:
        rt.close()


def scenario_stall(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 broadcasts through the gloo engine; the peer never joins: the op's own deadline ends it."""
    rt = create_runtime("cpu")
    try:
        comm = PyHcclCommunicator(dist.group.WORLD, backend="gloo", runtime=rt, op_timeout_s=1.0, init_timeout_s=20)  # type: ignore[arg-type]
        if rank != 0:
            time.sleep(4)  # in the group, never calls the broadcast
            return {"skipped": True}
        start = time.monotonic()
        error = _err(lambda: (comm.broadcast(torch.ones(4), 0), rt.current_stream().synchronize(30)))
        return {"broadcast": error, "seconds": time.monotonic() - start}
    finally:
        rt.close()


def scenario_context(rank: int, world: int) -> dict[str, Any]:
    rt = create_runtime("cpu")
    try:
        sums = []
        for _ in range(3):  # rebuild per round, as RL loops do: destroy releases each one
            with PyHcclCommunicator(dist.group.WORLD, runtime=rt, init_timeout_s=20) as comm:  # type: ignore[arg-type]
                out = comm.all_reduce(torch.ones(2))
                rt.current_stream().synchronize(30)  # the result is valid once its stream is synchronized
                sums.append(out.tolist())
        return {"sums": sums, "closed": _err(lambda: comm.all_reduce(torch.ones(2)))}
    finally:
        rt.close()


def scenario_unregistered(rank: int, world: int) -> dict[str, Any]:
    """A ProcessGroupGloo built directly on a TCPStore: torch.distributed has no default group at all."""
    store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), world, rank == 0,  # pyright: ignore[reportPrivateImportUsage]
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)  # fmt: skip
    group = dist.ProcessGroupGloo(dist.PrefixStore("hccl-test", store), rank, world, datetime.timedelta(seconds=30))  # pyright: ignore[reportPrivateImportUsage]
    rt = create_runtime("cpu")
    try:
        comm = PyHcclCommunicator(group, backend=os.environ.get("COMM_BACKEND", "auto"), runtime=rt, init_timeout_s=20)  # type: ignore[arg-type]
        out = {"registered": dist.is_initialized(), "rank": comm.rank, "world": comm.world_size}
        out.update(_exercise(comm, rank, world))
        return out
    finally:
        rt.close()


def scenario_stateless(rank: int, world: int) -> dict[str, Any]:
    """vLLM's StatelessProcessGroup, built and used the way TRL / OpenRLHF / vllm-ascend's engine do."""
    from vllm.distributed.utils import StatelessProcessGroup  # the vllm-marked scenario only

    pg = StatelessProcessGroup.create(host="127.0.0.1", port=int(os.environ["STORE_PORT"]), rank=rank,
                                      world_size=world)  # fmt: skip
    comm = PyHcclCommunicator(pg, device=0)  # upstream's call: (group, device)
    stream = comm.runtime.current_stream()
    x = torch.arange(8, dtype=torch.float32) + rank
    total = comm.all_reduce(x)  # upstream: a new tensor
    biggest = comm.all_reduce(x, dist.ReduceOp.MAX)  # upstream's positional order: (in_tensor, op, stream)
    smallest = comm.all_reduce(x, op=dist.ReduceOp.MIN, stream=stream)
    b = torch.full((5,), float(rank), dtype=torch.bfloat16)
    comm.broadcast(b, src=world - 1, stream=stream)
    stream.synchronize(30)
    comm.group.barrier()  # TRL's pattern after a broadcast: the caller's stateless group, its own barrier
    second = PyHcclCommunicator(pg, device=0)  # a second communicator on the same group gets its own prefix
    again = second.all_reduce(torch.full((3,), float(rank + 1)))
    second.runtime.current_stream().synchronize(30)
    out = {"engine": comm.engine, "rank": comm.rank, "world": comm.world_size, "sum": total.tolist(),
           "max": biggest.tolist(), "min": smallest.tolist(), "broadcast": b.float().tolist(),
           "second": again.tolist(), "second_engine": second.engine, "group_is_callers": comm.group is pg,
           "vllm_order": _err(lambda: comm.all_reduce(x, torch.zeros_like(x))),  # PyNccl's (in, out): refused
           "untouched_x": x.tolist()}  # fmt: skip
    second.close()
    comm.close()
    out["after_close"] = _err(lambda: comm.all_reduce(x))
    out["close_twice"] = _err(comm.close)
    return out


def scenario_stateless_nojoin(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 joins the stateless group but never builds the communicator: rank 0 must not hang."""
    from vllm.distributed.utils import StatelessProcessGroup  # the vllm-marked scenario only

    pg = StatelessProcessGroup.create(host="127.0.0.1", port=int(os.environ["STORE_PORT"]), rank=rank,
                                      world_size=world)  # fmt: skip
    if rank != 0:
        time.sleep(8)
        return {"skipped": True}
    start = time.monotonic()
    error = _err(lambda: PyHcclCommunicator(pg, device=0, init_timeout_s=3))
    return {"init": error, "seconds": time.monotonic() - start}


def scenario_cuda_comm(rank: int, world: int) -> dict[str, Any]:
    """The NCCL dialect on real GPUs (one per rank): the same communicator code as on the NPU."""
    rt = create_runtime("cuda", device_index=rank)
    comm = PyHcclCommunicator(dist.group.WORLD, rank, runtime=rt, init_timeout_s=60)  # type: ignore[arg-type]
    dev = torch.device("cuda", rank)
    x = torch.arange(8, dtype=torch.float32, device=dev) + rank
    y = comm.all_reduce(x)
    b = torch.full((6,), float(rank), dtype=torch.bfloat16, device=dev)
    comm.broadcast(b, src=world - 1)
    g = comm.all_gather(torch.full((2,), rank, dtype=torch.int64, device=dev))
    rs = comm.reduce_scatter(torch.arange(world * 3, dtype=torch.int32, device=dev))
    t = torch.arange(100, dtype=torch.int32, device=dev) * (1 - rank)
    (comm.send(t, 1) if rank == 0 else comm.recv(t, 0))
    rt.current_stream().synchronize(60)
    out = {"engine": comm.engine, "dialect": comm.dialect.name, "sum": y.tolist(), "broadcast": b.float().tolist(),
           "all_gather": g.tolist(), "reduce_scatter": rs.tolist(), "p2p": int(t.sum()),
           "wrong_device": _err(lambda: comm.all_reduce(torch.ones(2)))}  # fmt: skip
    comm.destroy()
    return out


SCENARIOS = {
    "cuda_comm": scenario_cuda_comm,
    "binding": scenario_binding,
    "mismatch": scenario_mismatch,
    "comm": scenario_comm,
    "comm_errors": scenario_comm_errors,
    "nojoin": scenario_nojoin,
    "stall": scenario_stall,
    "context": scenario_context,
    "unregistered": scenario_unregistered,
    "stateless": scenario_stateless,
    "stateless_nojoin": scenario_stateless_nojoin,
}
# scenarios that build their own group: no default torch.distributed group
STANDALONE = {"unregistered", "stateless", "stateless_nojoin"}


def main() -> None:
    scenario, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if scenario in STANDALONE:
        os.environ["STORE_PORT"] = str(port)
        print("RESULT " + json.dumps(SCENARIOS[scenario](rank, world)), flush=True)
        return
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    try:
        result = SCENARIOS[scenario](rank, world)
    finally:
        dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
