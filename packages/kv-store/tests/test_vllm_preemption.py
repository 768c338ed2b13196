"""A preempted request's saves in flight settle in ``handle_preemptions``, before vLLM's runner reuses its blocks.

vLLM 0.33's ``execute_model`` calls the connector's ``handle_preemptions(metadata)`` first, then
``_update_states`` zeroes the step's new blocks (``new_block_ids_to_zero``: Mamba and mixed-precision
caches) and copies ``kv_cache_block_copies``, and only then binds the metadata. A preempted
request's blocks may be among those new blocks in the very step that preempts it, so a save of
that request still reading them when ``bind_connector_metadata`` runs can copy the zeroed bytes
into the pool under the request's valid chunk keys (issue 21: found by the pool soak, sync mode,
seed 20261230, as a hit on a chunk holding the sentinel).

Real parts: vLLM's ``Scheduler`` preempts the request (7 usable blocks, two requests filling them,
the first one's decode needs an eighth), a factory-built ``AscendStoreConnector`` worker over CPU
caches, a real ``mooncake_master`` SIGSTOPped while the request's save is queued (a hung store,
SIGCONT from a child process 1.5 s later), the soak's runner-order step (`pool_soak_support`), whose
zeroing writes a sentinel. The pool's copy of every chunk of the preempted request is read back.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.timeout(120)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from pool_soak_support import (  # noqa: E402
    BLOCK,
    LAYERS,
    SENTINEL,
    Counters,
    Failure,
    SoakInstance,
    expected_values,
    make_config,
    prefix_hashes,
)

from ascend_dist.testing import vllm_builders as vb  # noqa: E402
from ascend_dist.testing.ports import free_port  # noqa: E402

NUM_BLOCKS = 8  # 7 usable: B (3 blocks) and A (4 blocks) fill them, B's first decode token needs an eighth
HANG_S = 1.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vb.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


def _store_client(address: str) -> Any:
    """A Mooncake store client contributing no memory, to read what the pool holds."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
    return client


@pytest.mark.parametrize("mode", [{}, {"use_layerwise": True}], ids=["whole-request", "layerwise"])
def test_a_preempted_requests_save_in_flight_never_stores_its_reused_blocks(
    model_dir: Path, fresh_master: Any, mode: dict[str, Any]
) -> None:
    config = make_config(
        model_dir, fresh_master.address, free_port(), prefix_caching=False, num_blocks=NUM_BLOCKS, **mode
    )
    inst = SoakInstance("i", config, NUM_BLOCKS)
    admin = _store_client(fresh_master.address)
    pid = fresh_master._proc.pid
    resumer: subprocess.Popen[bytes] | None = None
    counters = Counters()
    failures: list[Failure] = []  # wrong loads and saves queued from wrong blocks, as the soak checks them
    try:
        b_prompt = [7 + i % 50 for i in range(3 * BLOCK)]
        a_prompt = [100 + i % 90 for i in range(4 * BLOCK)]
        inst.add("b", b_prompt, 8)
        inst.add("a", a_prompt, 2)  # after b: the last running request is the one vLLM preempts

        def hang(_: SoakInstance, out: Any) -> None:  # both looked up (misses); a's save will meet the hung store
            nonlocal resumer
            os.kill(pid, signal.SIGSTOP)
            resumer = subprocess.Popen(["sh", "-c", f"sleep {HANG_S}; kill -CONT {pid}"])

        out1 = inst.step(1, counters, failures, on_scheduled=hang)
        a_meta = next(r for r in out1.kv_connector_metadata.step.requests if r.req_id == "a")
        a_blocks = list(a_meta.block_ids[0])
        assert a_meta.can_save and (a_meta.save_start_token, a_meta.save_end_token) == (0, 4 * BLOCK)
        stats = inst.worker._worker.stats  # type: ignore[union-attr]
        assert stats.saved_keys == 0  # control: a's save is still pending (the store hangs) when ...

        out2 = inst.step(2, counters, failures)
        assert out2.preempted_req_ids == {"a"}  # ... vLLM preempts a
        reused = set(inst.scheduler.kv_cache_manager.get_block_ids("b")[0]) & set(a_blocks)
        assert reused, "control: b got none of a's blocks this step"

        inst.worker._worker.drain(30)  # type: ignore[union-attr]
        assert stats.saved_keys >= 4, f"control: a's chunks were not saved once the store was back: {stats}"
        meta = inst.scheduler.connector._spec.key_metadata()[0]  # type: ignore[union-attr]
        hashes = prefix_hashes(a_prompt)
        wrong = []
        for j, chunk in enumerate(a_meta.block_hashes[:4]):
            keys = (
                [meta.layer_key(chunk, layer) for layer in range(len(LAYERS))]
                if mode.get("use_layerwise")
                else [meta.pool_key(chunk)]
            )
            got = torch.frombuffer(bytearray(b"".join(bytes(admin.get(k)) for k in keys)), dtype=torch.float16)
            want = expected_values(hashes[j * BLOCK : (j + 1) * BLOCK], range(len(LAYERS)))
            if not torch.equal(got, want):
                held = "the sentinel" if bool((got == SENTINEL).all()) else f"{got.numel()} other values"
                where = f"block {a_blocks[j]}" + (", reused by b" if a_blocks[j] in reused else "")
                wrong.append(f"chunk {j} ({where}): {held}")
        assert not wrong, f"the pool holds bytes a's blocks got after its preemption: {wrong}"
        assert not failures, failures
    finally:
        if resumer is not None:
            resumer.wait(timeout=HANG_S + 10)
        os.kill(pid, signal.SIGCONT)
        admin.close()
        inst.close()
