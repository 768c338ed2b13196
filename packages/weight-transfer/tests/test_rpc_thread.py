"""`beside_rpc`: the engines' RPC beside the trainer's side, both bounded, both errors kept; `bounded_rpc` alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.weight_transfer.errors import EngineRpcFailed
from ascend_dist.weight_transfer.rpc_thread import beside_rpc, bounded_rpc


def _refuse() -> None:
    raise ValueError("engine: refused")


def test_the_trainers_error_wins_when_it_follows_the_rpcs_and_carries_it_as_cause() -> None:
    """The RPC's refusal arrived first and hid the trainer's more precise error (a race seen under load)."""

    def local() -> None:
        time.sleep(0.3)  # the trainer's vote completes just after the engine's RPC failed
        raise KeyError("trainer: rejected by rank 1")

    with pytest.raises(KeyError, match="rank 1") as raised:
        beside_rpc("update_weights", _refuse, local, timeout_s=5, local_timeout_s=10)
    assert isinstance(raised.value.__cause__, ValueError)


def test_an_rpc_failure_alone_is_engine_rpc_failed_and_the_result_is_discarded() -> None:
    discarded: list[str] = []
    with pytest.raises(EngineRpcFailed, match="engine: refused") as raised:
        beside_rpc("init", _refuse, lambda: "group", timeout_s=5, local_timeout_s=10, discard=discarded.append)
    assert isinstance(raised.value.__cause__, ValueError)
    assert discarded == ["group"]


def test_a_hung_rpc_is_a_deadline_and_success_returns_the_trainers_result() -> None:
    release = threading.Event()
    try:
        with pytest.raises(DeadlineExceeded, match="update_weights did not return"):
            beside_rpc("update_weights", lambda: release.wait(30), lambda: 1, timeout_s=0.3, local_timeout_s=10)
    finally:
        release.set()
    assert beside_rpc("update_weights", lambda: None, lambda: 7, timeout_s=5, local_timeout_s=10) == 7


def test_bounded_rpc_returns_raises_unchanged_or_times_out() -> None:
    assert bounded_rpc("ok", lambda: 7, timeout_s=5.0) == 7
    refused = ValueError("the engine refused it")

    def refuse() -> None:
        raise refused

    with pytest.raises(ValueError) as caught:
        bounded_rpc("refuse", refuse, timeout_s=5.0)
    assert caught.value is refused  # the engine's own error, not wrapped
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"hung did not return within 0.3 s .*wt-rpc-hung"):
        bounded_rpc("hung", lambda: release.wait(30), timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0
    release.set()


def test_a_process_exiting_waits_for_the_trainers_abandoned_side_to_end() -> None:
    """The RPC failed at once, so the caller returned while the trainer's side still waited (a rendezvous
    nobody joins). As a daemon thread it was cut off inside torch's store wait at interpreter exit and the
    process aborted (the CI's ``vllm`` session, exit -6); now the exit waits for it to end by its deadline."""
    script = textwrap.dedent("""
        import time
        from ascend_dist.weight_transfer.errors import EngineRpcFailed
        from ascend_dist.weight_transfer.rpc_thread import LOCAL_GRACE_S, beside_rpc

        def refuse():
            raise ValueError("engine: refused")

        def local():
            time.sleep(LOCAL_GRACE_S + 1.5)  # outlives the grace: stands for the rendezvous' own deadline
            print("trainer side ended", flush=True)

        try:
            beside_rpc("init", refuse, local, timeout_s=5, local_timeout_s=30)
        except EngineRpcFailed:
            print("caller returned", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["caller returned", "trainer side ended"], out.stdout
