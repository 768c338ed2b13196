"""vllm-ascend's static trainer API against our workers: the trainer is `static_api/upstream_style_trainer.py`.

That process imports nothing of ours but `static_trainer` and calls only upstream's
``HCCLWeightTransferEngine.trainer_init`` / ``trainer_send_weights`` with upstream's argument types.
The two workers are ours (`BroadcastWorker` in worker processes, gloo on 127.0.0.1); this test plays
the framework's control plane (init, then start / update / finish each round).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ascend_dist.weight_transfer._demo.procs import WorkerProcess, synthetic_specs
from ascend_dist.weight_transfer.static_trainer import (
    HCCLTrainerSendWeightsArgs,
    HCCLWeightTransferEngine,
    HCCLWeightTransferInitInfo,
)

from .conftest import free_port

TRAINER = Path(__file__).parent / "static_api" / "upstream_style_trainer.py"
SPECS = [(f"w{i}", dtype, shape) for i, (_, dtype, shape) in
         enumerate(synthetic_specs(10, 48 * 1024, dtypes=("float32", "bfloat16", "float16")))]  # fmt: skip
BUFFER = 4096
TIMEOUT_S = 60.0  # the trainer process imports torch first: slow on a loaded 2-core VM


@pytest.mark.timeout(180)  # three processes start torch: seconds when quiet, minutes on a loaded 2-core VM
def test_a_trainer_written_to_the_static_api_updates_our_workers(
    spawn_workers: Callable[..., list[WorkerProcess]],
) -> None:
    workers = spawn_workers(2, SPECS)
    port = free_port()
    rounds = [(1, "dict"), (2, "dataclass"), (3, "unpacked")]
    spec = {"port": port, "world_size": 3, "buffer": BUFFER, "rounds": rounds,
            "specs": [[n, d, list(s)] for n, d, s in SPECS]}  # fmt: skip
    trainer = subprocess.Popen([sys.executable, str(TRAINER), json.dumps(spec)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for rank, proc in enumerate(workers, start=1):  # the framework tells the workers to join (upstream: RPC)
            proc.send("init", master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=3,
                      dp_index=rank - 1, replica_size=1, rank_in_replica=0, packed=True, buffer_size_bytes=BUFFER,
                      num_buffers=2, op_timeout_s=TIMEOUT_S, collective="gloo")  # fmt: skip
        for proc in workers:
            assert proc.reply(TIMEOUT_S)["ok"]
        before = workers[0].call("digest")["digests"]
        replies = []
        for _ in rounds:  # each round: start, update (concurrently with the trainer's send), finish
            for proc in workers:
                assert proc.call("start")["ok"]
                proc.send("update", names=[s[0] for s in SPECS], dtype_names=[s[1] for s in SPECS],
                          shapes=[list(s[2]) for s in SPECS])  # fmt: skip
            replies.append([proc.reply(TIMEOUT_S) for proc in workers])
            # the update's own outcome decides: a refused one is closed by the worker (a finish then says so)
            replies[-1].append([proc.call("finish") for proc in workers])
            replies[-1].append([proc.call("digest")["digests"] for proc in workers])
        out, err = trainer.communicate(timeout=TIMEOUT_S)
        assert trainer.returncode == 0, err[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(5)
    sent = [json.loads(line.removeprefix("ROUND ")) for line in out.splitlines() if line.startswith("ROUND ")]
    assert len(sent) == 3, out
    for i in (0, 1):  # dict and dataclass forms: every worker holds exactly what the trainer sent
        assert sent[i]["ok"], sent[i]
        assert all(r["ok"] for r in replies[i][:2]), replies[i]
        assert replies[i][3] == [sent[i]["digests"]] * 2
        assert sent[i]["digests"] != before  # control: the update changed the weights
    zeroed = SPECS[0][0]  # the post_iter_func was applied: the first tensor went out as zeros
    assert sent[1]["digests"][zeroed] != sent[0]["digests"][zeroed]
    # upstream's default packed=False against workers initialised packed: refused by every rank, weights kept
    assert not sent[2]["ok"] and sent[2]["error"].startswith("ManifestRejected") and "packed" in sent[2]["error"]
    assert not any(r["ok"] for r in replies[2][:2]), replies[2]
    assert replies[2][3] == [sent[1]["digests"]] * 2


def test_static_api_arguments_are_checked_before_anything_is_sent() -> None:
    with pytest.raises(ValueError, match=r"init_info\.world_size=None"):
        HCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": 1})
    with pytest.raises(ValueError, match=r"init_info=\['bogus'\]"):
        HCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2,
                                               "bogus": 1})  # fmt: skip
    with pytest.raises(ValueError, match=r"init_info\.rank_offset=2"):
        HCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": 1, "world_size": 3,
                                               "rank_offset": 2})  # fmt: skip
    with pytest.raises(ValueError, match=r"init_info\.rank_offset=0"):  # the dataclass form, upstream's field order
        HCCLWeightTransferEngine.trainer_init(HCCLWeightTransferInitInfo("127.0.0.1", 1, 0, 3))
    with pytest.raises(ValueError, match=r"trainer_args\.group='object'"):
        HCCLWeightTransferEngine.trainer_send_weights([], {"group": object()})
    with pytest.raises(ValueError, match=r"trainer_args=\['stream_id'\]"):
        HCCLWeightTransferEngine.trainer_send_weights([], {"group": object(), "stream_id": 1})
    with pytest.raises(ValueError, match=r"trainer_args\.group"):
        HCCLWeightTransferEngine.trainer_send_weights([], HCCLTrainerSendWeightsArgs(group=None, src=1))
