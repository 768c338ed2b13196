"""MooncakeConnectorV1 on D driven by vLLM 0.33.0's real v1 ``Scheduler``: load failure and abort.

D is vLLM's real ``Scheduler`` (its own scheduler-role connector, built by vLLM) plus a worker-role
connector from ``KVConnectorFactory``; P is a scheduler+worker pair (``pull_vllm_support.Side``)
over the same real Mooncake engine (TCP, loopback). The helpers (configs, P side, requests) are
shared with ``test_vllm_connector`` so both files build vLLM the same way.

1. Load failure with ``kv_load_failure_policy="recompute"``: P's worker is shut down (side channel
   closed, memory unregistered) before D pulls; D's worker reports exactly the blocks it allocated
   for the pull (not a prefix-hit block), vLLM truncates ``num_computed_tokens`` at the first of
   them and recomputes from there locally (with and without a one-block local prefix hit), and
   every block comes back to D's pool.
2. Abort while ``WAITING_FOR_REMOTE_KVS``: vLLM delays the free until D's worker reports the pull
   finished; D keeps no pull, tracker entry or pending work, its blocks come back, and P's lent
   blocks are released by D's DONE (not by the lease).
3. Abort before allocation: P is released by D's DONE, and D's worker reports no receive for the
   request vLLM already freed (vLLM's scheduler asserts on such a stray id; this was a connector bug).
4. ``get_num_new_matched_tokens`` is a pure query: asked twice it answers the same and changes
   nothing; the pull recorded after allocation carries D's prefix hit and completes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
pytest.importorskip("vllm")

# First import after the skip: it sets HF_HUB_OFFLINE before torch and vLLM load.
import pull_vllm_support as _h  # noqa: E402  (configs, the P side, requests)

model_dir = _h.model_dir  # the tiny-llama config directory fixture

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from ascend_dist.kv_mooncake._demo.peer_process import free_port_range  # noqa: E402
from ascend_dist.kv_mooncake.pull.vllm_connector import MooncakeConnectorV1, MooncakeConnectorV1Metadata  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402

PROMPT = 40  # tokens: blocks of 16, 16 and 8 on both sides
FAST_RPC = {"rpc_timeout_s": 0.3, "rpc_retries": 1}


class D:
    """D: vLLM's real v1 Scheduler and one worker-role connector with zeroed CPU caches."""

    def __init__(self, config: VllmConfig) -> None:
        kcc = _h.kv_cache_config()
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
        self.caches = {n: torch.zeros(2, _h.NUM_BLOCKS, _h.BLOCK, 2, 16, dtype=torch.float16) for n in _h.LAYERS}
        try:
            self.worker.register_kv_caches(self.caches)
            self.sched = Scheduler(
                vllm_config=config,
                kv_cache_config=kcc,
                structured_output_manager=StructuredOutputManager(config),
                block_size=_h.BLOCK,
                log_stats=False,
            )
        except BaseException:
            self.worker.shutdown()
            raise
        self.free_at_start = self.free_blocks()
        # vLLM's EngineCore gives every request this block hasher when a KV connector is configured.
        self._hasher = vb.block_hasher(config, kcc)

    def request(self, rid: str, tokens: int, params: dict[str, Any] | None = None) -> Request:
        """A request as EngineCore builds it: prompt ``100..``, one output token, P's params if given."""
        extra = {"kv_transfer_params": params} if params is not None else None
        sampling = SamplingParams(max_tokens=1, extra_args=extra)
        return Request(rid, list(range(100, 100 + tokens)), sampling, None, block_hasher=self._hasher)

    def free_blocks(self) -> int:
        """Blocks in D's pool that no request holds."""
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def run_worker(self, out: SchedulerOutput) -> None:
        """The worker's part of one step: apply the step's connector metadata."""
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        self.worker.clear_connector_metadata()

    def wait_recv(self, rid: str, timeout_s: float = 20.0) -> tuple[set[str], set[int]]:
        """Poll the worker until ``rid`` is reported received; return (finished_recving, load errors)."""
        done: set[str] = set()
        errors: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while rid not in done and time.monotonic() < deadline:
            errors |= self.worker.get_block_ids_with_load_errors()
            done |= self.worker.get_finished(set())[1] or set()
            time.sleep(0.005)
        errors |= self.worker.get_block_ids_with_load_errors()
        return done, errors

    def idle(self) -> dict[str, int]:
        """What D's connector halves still hold (all zero when nothing leaked)."""
        sched = self.sched.connector
        assert isinstance(sched, MooncakeConnectorV1) and isinstance(self.worker, MooncakeConnectorV1)
        receiver = self.worker._worker.receiver if self.worker._worker is not None else None
        assert sched._scheduler is not None and receiver is not None
        return {
            "sched_tracked": sched._scheduler.tracked,
            "in_flight": receiver.in_flight,
            "quarantined": receiver.quarantined,
        }

    def close(self) -> None:
        """Stop vLLM's scheduler (and its connector) and the worker connector."""
        self.sched.shutdown()
        self.worker.shutdown()


def output(
    *, sampled: dict[str, int] | None = None, recving: set[str] | None = None, invalid: set[int] | None = None
) -> ModelRunnerOutput:
    """One step's ModelRunnerOutput: sampled tokens and the connector's report."""
    ids = list(sampled or {})
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[t] for t in (sampled or {}).values()],
        kv_connector_output=KVConnectorOutput(finished_recving=recving or None, invalid_block_ids=invalid or set()),
    )


def prefill_on_p(p: Any, rid: str) -> dict[str, Any]:
    """P prefills ``PROMPT`` tokens into blocks 4, 5, 6 and hands its kv_transfer_params over."""
    req_p = _h.request(rid, PROMPT, {"do_remote_decode": True})
    p.sched.update_state_after_alloc(req_p, _h.blocks([4, 5, 6]), 0)
    p.step()
    req_p.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = p.sched.request_finished(req_p, [4, 5, 6])
    p.step()  # P's worker now holds blocks 4-6 lent to D
    assert delay is True and params is not None
    return params


def warm_prefix(d: D) -> None:
    """A local request shares the prompt's first block with D's request; its block stays cached."""
    warm = d.request("warm", _h.BLOCK + 4)
    d.sched.add_request(warm)
    out = d.sched.schedule()
    d.run_worker(out)
    d.sched.update_from_output(out, output(sampled={"warm": 7}))
    assert warm.is_finished() and d.free_blocks() == d.free_at_start


@pytest.mark.parametrize("hit", [0, 16], ids=["no-prefix-hit", "one-block-prefix-hit"])
def test_load_failure_is_recomputed_from_the_first_bad_block(model_dir: Path, hit: int) -> None:
    port = free_port_range(1)
    p = _h.Side(_h.make_config(model_dir, "kv_producer", "P-fail", port, **FAST_RPC), seed=5)
    config = _h.make_config(model_dir, "kv_consumer", "D-fail", port, **FAST_RPC)
    config.kv_transfer_config.kv_load_failure_policy = "recompute"
    d = D(config)
    p_open = True
    try:
        assert d.sched.recompute_kv_load_failures
        if hit:
            warm_prefix(d)
        params = prefill_on_p(p, "p-req")
        p.close()  # P goes away (server stopped, memory unregistered) before D pulls
        p_open = False
        req = d.request("d-req", PROMPT, params)
        d.sched.add_request(req)
        out = d.sched.schedule()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and out.num_scheduled_tokens == {}
        assert req.num_computed_tokens == PROMPT  # local hit + the external tokens vLLM will wait for
        held = d.sched.kv_cache_manager.get_block_ids("d-req")[0]
        pulled_into = held[hit // _h.BLOCK :]
        assert len(held) == 3 and len(pulled_into) == 3 - hit // _h.BLOCK
        d.run_worker(out)
        done, errors = d.wait_recv("d-req")
        # D's worker reports the request and exactly the blocks it allocated for the pull.
        assert done == {"d-req"} and errors == set(pulled_into)
        d.sched.update_from_output(out, output(recving=done, invalid=errors))
        assert req.num_computed_tokens == hit  # truncated at the first bad block
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        out = d.sched.schedule()
        # Rescheduled: everything from the first bad block is recomputed locally, nothing is pulled again.
        assert out.num_scheduled_tokens == {"d-req": PROMPT - hit}
        assert req.status == RequestStatus.RUNNING and req.num_computed_tokens == PROMPT
        assert req.kv_transfer_params is not None and req.kv_transfer_params["do_remote_prefill"] is False
        assert d.sched.kv_cache_manager.get_block_ids("d-req")[0][: hit // _h.BLOCK] == held[: hit // _h.BLOCK]
        d.run_worker(out)
        d.sched.update_from_output(out, output(sampled={"d-req": 7}))
        assert req.is_finished() and "d-req" not in d.sched.requests
        d.run_worker(d.sched.schedule())
        assert d.free_blocks() == d.free_at_start  # every block D allocated came back
        assert d.idle() == {"sched_tracked": 0, "in_flight": 0, "quarantined": 0}
        assert d.worker.get_block_ids_with_load_errors() == set()
    finally:
        d.close()
        if p_open:
            p.close()


def test_abort_while_waiting_for_remote_kv_frees_both_sides(model_dir: Path) -> None:
    port = free_port_range(1)
    p = _h.Side(_h.make_config(model_dir, "kv_producer", "P-abort", port, lease_s=60.0), seed=6)
    d = D(_h.make_config(model_dir, "kv_consumer", "D-abort", port))
    try:
        params = prefill_on_p(p, "p-req")
        req = d.request("d-req", PROMPT, params)
        d.sched.add_request(req)
        out = d.sched.schedule()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert d.free_blocks() == d.free_at_start - 3
        # The client goes away between the scheduler step and the worker's execution of it.
        aborted = d.sched.finish_requests("d-req", RequestStatus.FINISHED_ABORTED)
        assert [r.request_id for r in aborted] == ["d-req"]
        assert d.free_blocks() == d.free_at_start - 3  # vLLM delays the free: the pull may still write
        d.run_worker(out)
        done, errors = d.wait_recv("d-req")
        assert done == {"d-req"} and errors == set()
        started = time.monotonic()
        sent: set[str] = set()
        while "p-req" not in sent and time.monotonic() - started < 10:
            sent |= p.worker.get_finished(set())[0] or set()
            time.sleep(0.005)
        # P's blocks are released by D's DONE, long before the 60 s lease.
        assert sent == {"p-req"} and time.monotonic() - started < 10
        d.sched.update_from_output(out, output(recving=done))
        assert "d-req" not in d.sched.requests
        d.run_worker(d.sched.schedule())
        assert d.free_blocks() == d.free_at_start
        assert d.idle() == {"sched_tracked": 0, "in_flight": 0, "quarantined": 0}
    finally:
        d.close()
        p.close()


def test_abort_before_allocation_releases_p_without_a_stray_receive(model_dir: Path) -> None:
    port = free_port_range(1)
    p = _h.Side(_h.make_config(model_dir, "kv_producer", "P-early", port, lease_s=60.0), seed=7)
    d = D(_h.make_config(model_dir, "kv_consumer", "D-early", port))
    try:
        params = prefill_on_p(p, "p-req")
        d.sched.add_request(d.request("d-req", PROMPT, params))
        # Aborted while still WAITING (never scheduled): no blocks were allocated on D.
        d.sched.finish_requests("d-req", RequestStatus.FINISHED_ABORTED)
        assert "d-req" not in d.sched.requests and d.free_blocks() == d.free_at_start
        out = d.sched.schedule()  # carries the connector's empty receive (P must still free)
        d.run_worker(out)
        started = time.monotonic()
        sent: set[str] = set()
        while "p-req" not in sent and time.monotonic() - started < 10:
            sent |= p.worker.get_finished(set())[0] or set()
            time.sleep(0.005)
        assert sent == {"p-req"}  # P's blocks released by D's DONE
        done, errors = d.wait_recv("d-req", timeout_s=1.0)
        assert errors == set()
        assert d.idle() == {"sched_tracked": 0, "in_flight": 0, "quarantined": 0}
        # The receive only told P to free: vLLM no longer holds the request and asserts that a finished
        # receive belongs to one it holds, so D's worker must not report it.
        assert done == set()
        d.sched.update_from_output(out, output(recving=done))
        assert d.free_blocks() == d.free_at_start
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("hit", [0, 16], ids=["no-prefix-hit", "one-block-prefix-hit"])
def test_matched_tokens_query_is_pure_and_the_pull_is_recorded_after_allocation(model_dir: Path, hit: int) -> None:
    """vLLM may ask ``get_num_new_matched_tokens`` again for a request it could not schedule.

    Asked twice before vLLM's real Scheduler runs, the query gives the same answer and changes
    neither the request nor the connector; the pull then recorded by ``update_state_after_alloc``
    carries D's prefix hit (recovered from the external count) and completes.
    """
    port = free_port_range(1)
    p = _h.Side(_h.make_config(model_dir, "kv_producer", "P-pure", port, lease_s=60.0), seed=8)
    d = D(_h.make_config(model_dir, "kv_consumer", "D-pure", port))
    try:
        if hit:
            warm_prefix(d)
        params = prefill_on_p(p, "p-req")
        req = d.request("d-req", PROMPT, params)
        d.sched.add_request(req)
        conn = d.sched.connector
        assert isinstance(conn, MooncakeConnectorV1) and conn._scheduler is not None
        before = (dict(req.kv_transfer_params or {}), req.num_prompt_tokens, list(req.all_token_ids))
        answers = [conn.get_num_new_matched_tokens(req, hit) for _ in range(2)]
        assert answers == [(PROMPT - hit, True)] * 2
        assert (dict(req.kv_transfer_params or {}), req.num_prompt_tokens, list(req.all_token_ids)) == before
        assert conn._scheduler.tracked == 0  # nothing recorded by the query
        out = d.sched.schedule()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.num_computed_tokens == PROMPT
        meta = out.kv_connector_metadata
        assert isinstance(meta, MooncakeConnectorV1Metadata)
        pull = meta.inner.requests["d-req"]
        assert pull.num_computed_tokens == hit and not pull.notify_only
        assert req.kv_transfer_params is not None and req.kv_transfer_params["do_remote_prefill"] is False
        d.run_worker(out)
        done, errors = d.wait_recv("d-req")
        assert done == {"d-req"} and errors == set()
        d.sched.update_from_output(out, output(recving=done))
        out = d.sched.schedule()
        assert req.status == RequestStatus.RUNNING
        d.run_worker(out)
        d.sched.update_from_output(out, output(sampled={"d-req": 7}))
        assert req.is_finished()
        d.run_worker(d.sched.schedule())
        assert d.free_blocks() == d.free_at_start
        assert d.idle() == {"sched_tracked": 0, "in_flight": 0, "quarantined": 0}
    finally:
        d.close()
        p.close()
