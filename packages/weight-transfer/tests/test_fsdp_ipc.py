"""npu_ipc with two FSDP trainer ranks through vLLM's trainer API (marked vllm): `fsdp_ipc/trainer_rank.py`.

Each rank is a process of a gloo default group holding DTensor shards; vLLM's ``ModuleSource``
gathers them (``full_tensor``), every rank exports its copy on its own simulated chip, the handles
are merged on the default group and only rank 0 calls the client. The two inference workers are
vLLM-factory engines on chips 0 and 1, so each must find its own chip's handle in the merged list.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]  # each rank imports vLLM: slow on a loaded VM
pytest.importorskip("vllm")

RANK_SCRIPT = Path(__file__).parent / "fsdp_ipc" / "trainer_rank.py"


@pytest.mark.parametrize("mode", ["packed", "unpacked"])
def test_two_fsdp_trainer_ranks_update_the_worker_on_each_chip(mode: str) -> None:
    port = free_port()
    env = {**os.environ, "ASCEND_DIST_DEVICE": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), str(rank), str(port), mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
             for rank in range(2)]  # fmt: skip
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=200)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, f"rank {rank} exited {proc.returncode}:\n{err[-4000:]}"
            results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(5)
    sender, other = results
    assert sender["local_shapes"] != [[5, 3], [8], [], [4, 6], [7, 2]]  # control: the trainer really held shards
    assert other["local_shapes"] == [[2, 3], [4], [], [2, 6], [3, 2]]
    assert sender["rounds"] == [[True, True], [True, True]]  # both workers hold the full new weights, each round
    assert other["calls"] == []  # only rank 0 talks to the inference side
    assert sender["calls"][0] == "init" and sender["calls"].count("start") == 2 and sender["calls"][-1] == "finish"
    assert len(set(sender["uuids"])) == 2 and all(u.endswith(("-cpu0", "-cpu1")) for u in sender["uuids"])


def test_a_second_trainer_rank_without_a_default_group_is_refused() -> None:
    """Without torch.distributed there is nothing to gather on: a rank other than 0 would be a lone sender."""
    import torch
    from vllm.distributed.weight_transfer.base import ModuleSource

    from ascend_dist.common.errors import ConfigError
    from ascend_dist.weight_transfer.vllm_trainer import NPUIPCTrainerInitInfo, NPUIPCTrainerWeightTransferEngine

    class Client:  # never reached
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"client.{name} called")

    with pytest.raises(ConfigError, match=r"rank=1 is invalid"):
        NPUIPCTrainerWeightTransferEngine.trainer_init(
            NPUIPCTrainerInitInfo(rank=1),
            client=Client(),
            source=ModuleSource(torch.nn.Linear(2, 2)),  # type: ignore[arg-type]
        )
