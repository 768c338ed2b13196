"""Scheduler hooks, P's lease tracker, configuration and message validation (no engine)."""

from __future__ import annotations

from typing import Any

import pytest

from ascend_dist.common.errors import ConfigError, MessageTooLarge, ProtocolError
from ascend_dist.kv_mooncake.core.messages import Done, GetMeta
from ascend_dist.kv_mooncake.pull.config import ABORT_TIMEOUT_ENV, PullConfig
from ascend_dist.kv_mooncake.pull.messages import parse_transfer_params, request_codec
from ascend_dist.kv_mooncake.pull.scheduler import PullScheduler, SchedRequest
from ascend_dist.kv_mooncake.pull.tracker import SendTracker

EXTRA: dict[str, Any] = {"prefill": {"tp_size": 2, "dp_size": 2}, "decode": {"tp_size": 1}}


def _config(role: str = "kv_producer", **extra: Any) -> PullConfig:
    return PullConfig.from_kv_transfer_config(engine_id="E", kv_role=role, kv_port=40000, extra={**EXTRA, **extra})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="kv_role"):
        PullConfig.from_kv_transfer_config(engine_id="E", kv_role="both", kv_port=1, extra=EXTRA)
    with pytest.raises(ConfigError, match=r"prefill\.tp_size"):
        PullConfig.from_kv_transfer_config(
            engine_id="E", kv_role="kv_producer", kv_port=1, extra={**EXTRA, "prefill": {}}
        )
    with pytest.raises(ConfigError, match=r"decode\.pp_size"):
        _config(decode={"tp_size": 1, "pp_size": 2})
    with pytest.raises(ConfigError, match="mooncake_protocol"):
        _config(mooncake_protocol="udp")
    with pytest.raises(ConfigError, match="host"):
        _config(host="0.0.0.0")
    with pytest.raises(ConfigError, match="kv_port"):
        PullConfig.from_kv_transfer_config(engine_id="E", kv_role="kv_producer", kv_port=65534, extra=EXTRA)


def test_transfer_params_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"kv_transfer_params\.remote_port"):
        parse_transfer_params({"remote_port": "x"})
    with pytest.raises(ConfigError, match=r"kv_transfer_params\.remote_host"):
        parse_transfer_params(
            {
                "do_remote_prefill": True,
                "remote_engine_id": "P",
                "remote_request_id": "r",
                "remote_port": 1,
                "remote_block_ids": [[1]],
            }
        )
    with pytest.raises(ConfigError, match=r"kv_transfer_params\.remote_block_ids"):
        parse_transfer_params({"remote_block_ids": [[1, "a"]]})


def test_codec_refuses_garbage_and_oversized_frames() -> None:
    codec = request_codec(1024)
    assert codec.decode(codec.encode(Done(request_id="r", d_rank=0, ok=True))) == Done(
        request_id="r", d_rank=0, ok=True
    )
    with pytest.raises(ProtocolError):
        codec.decode(b"\xc1garbage")
    with pytest.raises(MessageTooLarge):
        codec.decode(b"\x00" * 2048)
    with pytest.raises(ProtocolError):
        codec.decode(codec.encode(Done(request_id="r", d_rank=0, ok=True))[:-1])
    assert GetMeta.__struct_config__.tag == "get_meta"


def test_producer_request_finished_delays_free_with_trimmed_params() -> None:
    sched = PullScheduler(_config(dp_rank=1), [16])
    req = SchedRequest("p1", 33, {"do_remote_decode": True})
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, [[10, 11, 12, 13, 14]], 0)
    meta = sched.build_connector_meta()
    assert meta.in_batch == ["p1"] and not meta.requests
    req.length_capped = True
    delay, params = sched.request_finished(req, [[10, 11, 12, 13, 14]])
    assert delay is True and params is not None
    assert params["remote_block_ids"] == [[10, 11, 12]]
    assert params["remote_port"] == 40000 + 1 * 2  # DP rank 1's base
    assert params["remote_request_id"] == "p1" and params["do_remote_prefill"] is True
    assert sched.build_connector_meta().to_send == ["p1"]
    assert sched.tracked == 0


def test_aborted_producer_request_is_freed_at_once() -> None:
    sched = PullScheduler(_config(), [16])
    assert sched.request_finished(SchedRequest("p", 10, {"do_remote_decode": True}), [[1]]) == (False, None)
    assert sched.request_finished(SchedRequest("q", 10, None), [[1]]) == (False, None)


def test_a_producer_request_ending_without_lending_is_dropped_by_the_workers() -> None:
    """Stopped (EOS on the first token) or aborted after its batch was announced: the workers must
    forget it (``to_drop``); one that ends before the announcement is simply not announced."""
    sched = PullScheduler(_config(), [16])
    eos = SchedRequest("eos", 10, {"do_remote_decode": True})
    sched.update_state_after_alloc(eos, [[1]], 0)
    assert sched.build_connector_meta().in_batch == ["eos"]
    assert sched.request_finished(eos, [[1]]) == (False, None)
    early = SchedRequest("early", 10, {"do_remote_decode": True})
    sched.update_state_after_alloc(early, [[2]], 0)
    assert sched.request_finished(early, [[2]]) == (False, None)  # aborted before any step announced it
    meta = sched.build_connector_meta()
    assert (meta.to_drop, meta.in_batch, meta.to_send) == (["eos"], [], [])
    assert sched.tracked == 0


def _params() -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "p1",
        "remote_host": "127.0.0.1",
        "remote_port": 40000,
        "remote_block_ids": [[3, 4, 5]],
        "remote_ptp_size": 2,
    }


def test_consumer_flow_and_single_transfer() -> None:
    sched = PullScheduler(_config("kv_consumer"), [16])
    req = SchedRequest("d1", 40, _params())
    assert sched.get_num_new_matched_tokens(req, 16) == (24, True)
    sched.update_state_after_alloc(req, [[7, 8]], 24)
    assert req.kv_transfer_params is not None and req.kv_transfer_params["do_remote_prefill"] is False
    meta = sched.build_connector_meta()
    rm = meta.requests["d1"]
    assert (rm.local_block_ids, rm.remote_block_ids, rm.num_computed_tokens) == ([[7, 8]], [[3, 4, 5]], 16)
    assert sched.get_num_new_matched_tokens(req, 16) == (0, False)  # flag flipped: one transfer only
    assert sched.request_finished(req, [[7, 8]]) == (False, None)
    assert sched.tracked == 0


def test_matched_tokens_query_is_pure_on_both_roles() -> None:
    """Asked twice (vLLM re-asks a request it could not schedule): same answer, nothing written."""
    d = PullScheduler(_config("kv_consumer"), [16])
    req = SchedRequest("d1", 40, _params())
    before = dict(req.kv_transfer_params or {})
    assert [d.get_num_new_matched_tokens(req, 16) for _ in range(2)] == [(24, True)] * 2
    assert req.kv_transfer_params == before and req.prompt_len == 40 and d.tracked == 0
    hybrid = PullScheduler(_config("kv_producer"), [16, 16], state_groups=[1])
    preq = SchedRequest("p1", 41, {"do_remote_decode": True})
    assert [hybrid.get_num_new_matched_tokens(preq, 0) for _ in range(2)] == [(0, False)] * 2
    assert preq.prompt_len == 41 and preq.kv_transfer_params == {"do_remote_decode": True}  # not truncated
    assert hybrid.tracked == 0


def test_rejected_consumer_request_sends_an_empty_receive() -> None:
    sched = PullScheduler(_config("kv_consumer"), [16, 16])
    req = SchedRequest("d2", 40, {**_params(), "remote_block_ids": [[3], [4]]})
    sched.get_num_new_matched_tokens(req, 0)
    assert sched.request_finished(req, [[], []]) == (False, None)
    rm = sched.build_connector_meta().requests["d2"]
    assert rm.local_block_ids == [[], []]  # one empty list per group, never a bare []
    assert sched.tracked == 0


def test_group_count_mismatch_is_a_typed_error() -> None:
    sched = PullScheduler(_config("kv_consumer"), [16, 16])
    req = SchedRequest("d3", 40, _params())
    sched.get_num_new_matched_tokens(req, 0)
    with pytest.raises(ConfigError, match="local_block_ids"):
        sched.update_state_after_alloc(req, [[1, 2, 3]], 40)


def test_tracker_waits_for_every_done_and_ignores_duplicates() -> None:
    """A DONE resent by the RPC client (same sender) counts once: two D ranks' DONEs free the blocks."""
    t = SendTracker(10.0, clock=Clock())
    t.add_processing("a")
    t.add_delayed("a", 2)
    assert t.done("a", (0, "pcp0/-1")) and t.take_finished() == set()
    assert t.done("a", (0, "pcp0/-1")) and t.take_finished() == set()  # the retry: still held
    assert t.renew("a")
    t.done("a", (1, "pcp0/-1"))
    assert t.take_finished() == {"a"}
    assert not t.done("a", (1, "pcp0/-1")) and not t.done("unknown")
    assert t.take_finished() == set() and len(t) == 0


def test_tracker_counts_dones_that_arrive_before_the_delayed_free() -> None:
    t = SendTracker(10.0, clock=Clock())
    t.add_processing("a")
    t.done("a", (0, "x"))
    t.done("a", (0, "x"))  # a resent early DONE is still one sender
    t.add_delayed("a", 2)
    assert t.take_finished() == set() and t.renew("a")
    t.done("a", (1, "x"))
    assert t.take_finished() == {"a"} and len(t) == 0


def test_tracker_drops_a_request_that_ends_without_lending() -> None:
    """Stopped or aborted on P: forgotten at once; one already lent keeps its lease."""
    t = SendTracker(10.0, clock=Clock())
    t.add_processing("eos")
    t.done("eos", (0, "x"))
    t.drop("eos")
    assert len(t) == 0 and not t.renew("eos") and t.take_finished() == set()
    t.add_processing("lent")
    t.add_delayed("lent", 1)
    t.drop("lent")  # too late to drop: D may be reading it
    assert t.renew("lent") and len(t) > 0


def test_tracker_forgets_a_processing_request_past_its_deadline() -> None:
    """A request whose end never reached the worker is not "held" forever (renew says no after it)."""
    clock = Clock()
    t = SendTracker(5.0, processing_s=3.0, clock=clock)
    t.add_processing("lost")
    clock.now = 2.0
    t.add_processing("lost")  # seen in a batch again (a preemption): the deadline restarts
    clock.now = 4.5
    assert t.take_finished() == set() and t.renew("lost")
    clock.now = 5.5
    assert t.take_finished() == set()  # nothing to free: P never lent it
    assert not t.renew("lost") and len(t) == 0


def test_tracker_lease_expires_and_renew_extends_it() -> None:
    clock = Clock()
    t = SendTracker(5.0, clock=clock)
    for rid in ("a", "b"):
        t.add_processing(rid)
        t.add_delayed(rid, 1)
    clock.now = 4.0
    assert t.renew("b") and not t.renew("zzz")
    clock.now = 6.0
    assert t.take_finished() == {"a"} and t.expired_count == 1
    clock.now = 9.5
    assert t.take_finished() == {"b"} and len(t) == 0


def test_tracker_holds_only_requests_whose_blocks_it_still_has() -> None:
    """`renew` is D's check before a read: a consumed or unknown request must not be read (replays)."""
    t = SendTracker(5.0, clock=Clock())
    assert not t.renew("never-seen")
    t.add_processing("a")
    assert t.renew("a")  # still in P's batch: D may arrive before the delayed-free notice
    t.add_delayed("a", 1)
    assert t.renew("a")
    t.done("a")
    assert t.take_finished() == {"a"}
    assert not t.renew("a")  # consumed: its blocks may already hold another request's KV


def test_tracker_zero_fan_in_frees_at_once() -> None:
    t = SendTracker(5.0, clock=Clock())
    t.add_processing("a")
    t.add_delayed("a", 0)
    assert t.take_finished() == {"a"}


def test_lease_defaults_to_upstreams_abort_timeout_variable() -> None:
    """``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` (upstream's lease) is the default of ``lease_s``."""
    base = {"engine_id": "E", "kv_role": "kv_producer", "kv_port": 1, "extra": EXTRA}
    assert PullConfig.from_kv_transfer_config(**base, environ={}).lease_s == 60.0
    env = {ABORT_TIMEOUT_ENV: "480"}
    assert PullConfig.from_kv_transfer_config(**base, environ=env).lease_s == 480.0
    explicit = {**base, "extra": {**EXTRA, "lease_s": 5}}
    assert PullConfig.from_kv_transfer_config(**explicit, environ=env).lease_s == 5.0  # the config wins
    for bad in ("soon", "0", "-1", "nan"):
        with pytest.raises(ConfigError, match=ABORT_TIMEOUT_ENV):
            PullConfig.from_kv_transfer_config(**base, environ={ABORT_TIMEOUT_ENV: bad})


def test_tracker_serves_one_reader_per_slot() -> None:
    """Each (D rank, task) slot is bound to the first reader naming it: another reader (the same params
    replayed to a second D request) is refused, its renewal extends nothing and its DONE frees nothing."""
    clock = Clock()
    t = SendTracker(5.0, clock=clock)
    t.add_processing("a")
    t.add_delayed("a", 2)
    assert t.renew("a", (0, "s"), "r1")
    clock.now = 4.0
    assert not t.renew("a", (0, "s"), "r2") and t.refused_readers == 1
    assert t.held_for("a") == 1.0  # the refused renewal did not extend r1's lease
    assert t.renew("a", (1, "s"), "r2")  # another D rank's slot: its own reader
    assert not t.done("a", (0, "s"), "r2") and t.refused_readers == 2
    assert t.done("a", (1, "s"), "r2") and t.take_finished() == set()  # one of two slots done
    assert t.done("a", (0, "s"), "r1") and t.take_finished() == {"a"} and len(t) == 0


def test_tracker_promises_the_rest_of_a_lent_requests_lease() -> None:
    """`held_for` is what P promises D in `Held.lease_s`: nothing before the lease begins."""
    clock = Clock()
    t = SendTracker(5.0, clock=clock)
    assert t.held_for("never-seen") == 0.0
    t.add_processing("a")
    assert t.renew("a") and t.held_for("a") == 0.0  # in P's batch: its lease has not begun
    t.add_delayed("a", 1)
    clock.now = 2.0
    assert t.held_for("a") == 3.0
    assert t.renew("a") and t.held_for("a") == 5.0
    clock.now = 7.5
    assert t.take_finished() == {"a"} and t.held_for("a") == 0.0


def test_tracker_lease_renews_and_answers_the_promise_in_one_step() -> None:
    """`lease` is what P's `Renew` handler sends: None (not held), 0 (in P's batch) or the lease renewed."""
    clock = Clock()
    t = SendTracker(5.0, clock=clock)
    assert t.lease("never-seen") is None
    t.add_processing("a")
    assert t.lease("a", (0, "s"), "r1") == 0.0  # held, but its lease has not begun
    t.add_delayed("a", 1)
    clock.now = 4.0
    assert t.lease("a", (0, "s"), "r1") == 5.0 and t.held_for("a") == 5.0  # renewed from now
    assert t.lease("a", (0, "s"), "r2") is None and t.held_for("a") == 5.0  # another reader: nothing extended
    clock.now = 9.5
    assert t.take_finished() == {"a"} and t.lease("a", (0, "s"), "r1") is None


def test_tracker_forgets_readers_of_a_request_freed_on_arrival() -> None:
    """Every DONE came before the delayed-free notice: the request finishes at once, its readers too."""
    t = SendTracker(5.0, clock=Clock())
    t.add_processing("a")
    assert t.done("a", (0, "s"), "r1")
    t.add_delayed("a", 1)
    assert t.take_finished() == {"a"} and len(t) == 0
