"""Pure tests of the layer-wise planning, rearrangement, reuse gate, receiver, scheduler and wire."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from ascend_dist.common.errors import ConfigError, DeadlineExceeded, LayoutError, ProtocolError, TransferError
from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver
from ascend_dist.kv_mooncake.core.mappings import ParallelInfo, get_cp_group, get_tp_rank_head_mapping, pd_head_ratio
from ascend_dist.kv_mooncake.core.messages import TensorMeta
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.core.transfer_mappings import Endpoint
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.gate import ReuseGate
from ascend_dist.kv_mooncake.push.messages import LayerDone, PushDone, parse_push_params, request_codec
from ascend_dist.kv_mooncake.push.plan import (
    a2a_groups,
    a2a_member_index,
    as_descriptors,
    block_runs,
    plain_pieces,
    plan_request,
    resharded_pieces,
)
from ascend_dist.kv_mooncake.push.receiver import LayerReceiver
from ascend_dist.kv_mooncake.push.reshard import chunk_major, rearrange_output
from ascend_dist.kv_mooncake.push.scheduler import LayerwiseScheduler, RecvReqMeta, Scheduled


def _cfg(role: str = "kv_consumer", **extra: Any) -> LayerwiseConfig:
    base = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, **extra}
    return LayerwiseConfig.from_kv_transfer_config(engine_id="e", kv_role=role, kv_port=40000, extra=base)


# ---- planning (worked example) --------------------------------------------------------------------------------


def _plan(tp_rank: int, p: ParallelInfo, d: ParallelInfo, heads: int, **kw: Any) -> Any:
    args: dict[str, Any] = {
        "transfer_id": "r",
        "req_idx": 0,
        "p": p,
        "d": d,
        "tp_rank": tp_rank,
        "pcp_rank": 0,
        "num_heads": heads,
        "block_size": 4,
        "local_block_ids": [[10, 11, 12]],
        "remote_block_ids": [[5, 6, 7]],
        "d_host": "h",
        "d_base_port": 9000,
        "prompt_len": 10,
        "computed_tokens": 10,
        "transed_tokens": 0,
        "remote_cached_tokens": 0,
        "chunk_finished": True,
    }
    args.update(kw)
    return plan_request(**args)


def test_tp2_to_tp1_both_ranks_send_every_block_to_d0_and_d_waits_for_two() -> None:
    p, d = ParallelInfo(2, pd_head_ratio=2), ParallelInfo(1)
    for rank in (0, 1):
        plan = _plan(rank, p, d, 2)
        (task,) = plan.tasks
        assert task.endpoint == Endpoint("h", 9000)
        assert (task.local_block_ids, task.remote_block_ids, task.trans_count) == ((10, 11, 12), (5, 6, 7), 2)
        assert plan.done_to == ((Endpoint("h", 9000), 2),) and plan.chunk_finished
        assert a2a_member_index(rank, p, 2) == rank


@pytest.mark.parametrize(("p_tp", "heads", "d_tp"), [(2, 2, 1), (4, 4, 2), (4, 2, 1), (4, 2, 2), (8, 4, 2), (8, 2, 1)])
def test_all_to_all_groups_fill_one_d_rank_from_one_head_replica(p_tp: int, heads: int, d_tp: int) -> None:
    """Each group's heads are exactly one D rank's heads, from one replica, in member order.

    With more P ranks than heads the members are strided (replicas of a head are consecutive ranks);
    the consecutive groups built before paired two replicas of the same head (4 ranks, 2 heads: ranks
    0 and 1 both hold head 0), which exchanged the wrong slices or deadlocked.
    """
    ratio = pd_head_ratio(p_tp, d_tp, heads)
    p = ParallelInfo(p_tp, pd_head_ratio=ratio)
    groups = a2a_groups(p_tp, heads, ratio)
    assert sorted(r for g in groups for r in g) == list(range(p_tp))
    p_heads, d_heads = get_tp_rank_head_mapping(heads, p_tp), get_tp_rank_head_mapping(heads, d_tp)
    replicas = [set(g) for g in get_cp_group(p_tp, heads, 1)]
    for group in groups:
        assert len(group) == ratio
        assert [a2a_member_index(r, p, heads) for r in group] == list(range(ratio))
        assert sorted(h for r in group for h in p_heads[r]) in d_heads.values()
        assert any(set(group) <= rep for rep in replicas)
    if p_tp > heads and ratio > 1:  # control: consecutive ranks hold the same head
        consecutive = list(range(ratio))
        assert sorted(h for r in consecutive for h in p_heads[r]) not in d_heads.values()


def test_prefix_hit_and_chunk_windows() -> None:
    p, d = ParallelInfo(1), ParallelInfo(1)
    hit = _plan(0, p, d, 2, remote_cached_tokens=4)
    assert hit.tasks[0].local_block_ids == (11, 12)
    first = _plan(0, p, d, 2, computed_tokens=6, chunk_finished=False)
    assert first.tasks[0].local_block_ids == (10,) and not first.chunk_finished  # only whole blocks mid-prompt
    rest = _plan(0, p, d, 2, transed_tokens=4)
    assert rest.tasks[0].local_block_ids == (11, 12) and rest.chunk_finished


def test_tp2_to_tp2_is_rank_to_rank() -> None:
    p, d = ParallelInfo(2), ParallelInfo(2)
    assert _plan(1, p, d, 2).tasks[0].endpoint == Endpoint("h", 9001)
    assert _plan(1, p, d, 2).tasks[0].trans_count == 1


def test_descriptors_plain_merge_runs_and_resharded_land_at_member_offsets() -> None:
    local = [TensorMeta(0x1000, 64, 64, 4, 1, 16)]
    remote = [TensorMeta(0x9000, 64, 64, 4, 1, 16)]
    assert block_runs([1, 2, 5], [7, 8, 3]) == [(1, 7, 2), (5, 3, 1)]
    d = as_descriptors(plain_pieces(local, remote, block_runs([1, 2, 5], [7, 8, 3])))
    assert d.local.tolist() == [0x1000 + 64, 0x1000 + 320] and d.lengths.tolist() == [128, 64]
    assert d.remote.tolist() == [0x9000 + 7 * 64, 0x9000 + 3 * 64]
    d_remote = [TensorMeta(0x9000, 128, 128, 4, 2, 16)]
    r = as_descriptors(resharded_pieces([0x5000], local, d_remote, [0, 1], [7, 9], member=1, ratio=2))
    # P's 64-byte slice of each block lands in the second half (member 1) of D's 128-byte block.
    assert r.local.tolist() == [0x5000, 0x5000 + 64] and r.lengths.tolist() == [64, 64]
    assert r.remote.tolist() == [0x9000 + 7 * 128 + 64, 0x9000 + 9 * 128 + 64]
    strided = [TensorMeta(0x9000, 64, 96, 4, 1, 16)]  # D blocks with padding: one piece per block
    assert plain_pieces(local, strided, block_runs([1, 2], [7, 8])) == (
        [0x1040, 0x1080],
        [0x9000 + 672, 0x9000 + 768],
        [64, 64],
    )
    with pytest.raises(LayoutError):
        plain_pieces(local, d_remote, block_runs([1], [1]))
    with pytest.raises(ConfigError):
        resharded_pieces([0x5000], local, d_remote, [0], [7], member=2, ratio=2)


def test_alltoall_rearrangement_worked_example() -> None:
    """The head -> token all-to-all by hand: b=4, r=2, h=1, dim=1, 2 blocks."""
    r0 = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13]).reshape(8, 1, 1)
    r1 = r0 + 100
    sent = [chunk_major(x, 2, 4) for x in (r0, r1)]
    got = [rearrange_output(torch.cat([sent[s][j * 4 : (j + 1) * 4] for s in range(2)]), 2, 1) for j in range(2)]
    assert got[0].flatten().tolist() == [0, 100, 1, 101, 10, 110, 11, 111]
    assert got[1].flatten().tolist() == [2, 102, 3, 103, 12, 112, 13, 113]
    with pytest.raises(ConfigError):
        chunk_major(r0, 3, 4)


# ---- reuse gate -----------------------------------------------------------------------------------------


def test_reuse_gate_blocks_until_complete_and_reports_errors() -> None:
    gate = ReuseGate({0: [1, 2], 1: [2, 3]}, alive=lambda: True)
    assert gate.wait_for_layer_reuse(0, 0.1) is None
    gate.mark_pending(0)
    assert gate.pending(1)  # slot 2 is shared with layer 1
    threading.Timer(0.1, gate.complete, args=(0, "D gone")).start()
    start = time.monotonic()
    assert gate.wait_for_layer_reuse(1, 2.0) == "D gone"
    assert time.monotonic() - start >= 0.09
    gate.mark_pending(0)
    with pytest.raises(DeadlineExceeded):
        gate.wait_for_layer_reuse(0, 0.1)
    dead = ReuseGate({0: [1]}, alive=lambda: False)
    dead.mark_pending(0)
    with pytest.raises(TransferError):
        dead.wait_for_layer_reuse(0, 5.0)
    with pytest.raises(ConfigError):
        gate.mark_pending(7)


# ---- receiver -------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_receiver_counts_distinct_senders_and_reports_failures_with_blocks() -> None:
    clock = _Clock()
    rx = LayerReceiver(2, first_layer_timeout_s=5.0, layer_timeout_s=1.0, clock=clock)
    rx.expect(RecvReqMeta(request_id="int-a", transfer_id="a", block_ids=[[1, 2], [3]]))
    assert rx.on_layer_done(LayerDone(sender="p0", layers=[0], request_ids=["a"], trans_count=2)) == []
    rx.on_done(PushDone(sender="p0", request_id="a", trans_count=2, ok=True))
    rx.on_done(PushDone(sender="p0", request_id="a", trans_count=2, ok=True))  # duplicate: no over-count
    assert rx.take_finished()[0] == set()
    rx.on_done(PushDone(sender="p1", request_id="a", trans_count=2, ok=True))
    assert rx.take_finished() == ({"int-a"}, set(), {})
    # Early messages (before expect) are kept; a gap longer than layer_timeout_s fails the request.
    rx.on_layer_done(LayerDone(sender="p0", layers=[0], request_ids=["b"], trans_count=1))
    rx.expect(RecvReqMeta(request_id="int-b", transfer_id="b", block_ids=[[4, 5]]))
    clock.now = 1.5
    done, errors, reasons = rx.take_finished()
    assert done == {"int-b"} and errors == {4, 5} and "layer 1" in reasons["int-b"]
    assert rx.on_layer_done(LayerDone(sender="p0", layers=[1], request_ids=["b"], trans_count=1)) == ["b"]
    assert len(rx) == 0


def test_receiver_counts_a_layer_reported_twice_by_one_sender_once() -> None:
    """A repeated LayerDone (same sender, same layer) must not advance the layer count the failure names."""
    clock = _Clock()
    rx = LayerReceiver(3, first_layer_timeout_s=5.0, layer_timeout_s=1.0, clock=clock)
    rx.expect(RecvReqMeta(request_id="int-d", transfer_id="d", block_ids=[[7]]))
    for _ in range(2):
        rx.on_layer_done(LayerDone(sender="p0", layers=[0], request_ids=["d"], trans_count=1))
    clock.now = 1.5
    _, _, reasons = rx.take_finished()
    assert "layer 1 did not arrive" in reasons["int-d"], reasons


def test_receiver_fences_a_failed_request_until_every_claimant_ended() -> None:
    """D gave up, but a claimant may still write: the failure (and vLLM's recompute) waits for its PushDone."""
    clock = _Clock()
    rx = LayerReceiver(2, first_layer_timeout_s=5.0, layer_timeout_s=1.0, fence_timeout_s=10.0, clock=clock)
    rx.expect(RecvReqMeta(request_id="int-f", transfer_id="f", block_ids=[[3, 4]]))
    assert rx.on_claim("p0", ["f"]) == [] and rx.on_claim("p1", ["f"]) == []
    rx.on_layer_done(LayerDone(sender="p0", layers=[0], request_ids=["f"], trans_count=2))
    clock.now = 1.5  # p1 never reported layer 0: D gives up
    assert rx.take_finished() == (set(), set(), {})  # held: p0 and p1 may still write
    assert rx.on_claim("p0", ["f"]) == ["f"]  # no new writes
    assert rx.on_layer_done(LayerDone(sender="p1", layers=[0], request_ids=["f"], trans_count=2)) == ["f"]
    assert rx.on_done(PushDone(sender="p0", request_id="f", trans_count=2, ok=False, reason="told")) is False
    assert rx.take_finished() == (set(), set(), {})  # p1 has not ended yet
    rx.on_done(PushDone(sender="p1", request_id="f", trans_count=2, ok=True))
    done, errors, reasons = rx.take_finished()
    assert done == {"int-f"} and errors == {3, 4} and "layer 0 did not arrive" in reasons["int-f"]
    assert rx.on_claim("p0", ["f"]) == ["f"] and len(rx) == 0
    # Unclaimed: reported at once, and a late claim is refused (the late P writes nothing).
    rx.expect(RecvReqMeta(request_id="int-g", transfer_id="g", block_ids=[[5]]))
    clock.now = 7.0
    assert rx.take_finished()[0] == {"int-g"}
    assert rx.on_claim("p0", ["g"]) == ["g"]
    # A claimant that never ends: reported after fence_timeout_s.
    rx.expect(RecvReqMeta(request_id="int-h", transfer_id="h", block_ids=[[6]]))
    rx.on_claim("p0", ["h"])
    clock.now = 12.5
    assert rx.take_finished()[0] == set()
    clock.now = 22.6
    assert rx.take_finished()[0] == {"int-h"}


def test_receiver_reports_a_request_failed_before_this_worker_knew_it() -> None:
    """P's failed PushDone arrives before the step announcing the request: vLLM must still see it fail."""
    rx = LayerReceiver(2, first_layer_timeout_s=5.0, layer_timeout_s=1.0, clock=_Clock())
    rx.on_claim("p0", ["e"])
    assert rx.on_done(PushDone(sender="p0", request_id="e", trans_count=1, ok=False, reason="boom"))
    assert rx.take_finished() == (set(), set(), {})
    rx.expect(RecvReqMeta(request_id="int-e", transfer_id="e", block_ids=[[8, 9]]))
    done, errors, reasons = rx.take_finished()
    assert done == {"int-e"} and errors == {8, 9} and "boom" in reasons["int-e"]


def test_receiver_failed_done_and_first_layer_deadline() -> None:
    clock = _Clock()
    rx = LayerReceiver(2, first_layer_timeout_s=5.0, layer_timeout_s=1.0, clock=clock)
    rx.expect(RecvReqMeta(request_id="x", transfer_id="x", block_ids=[[1]]))
    rx.expect(RecvReqMeta(request_id="y", transfer_id="y", block_ids=[[2]]))
    rx.on_done(PushDone(sender="p0", request_id="x", trans_count=1, ok=False, reason="boom"))
    clock.now = 5.5
    done, errors, reasons = rx.take_finished()
    assert done == {"x", "y"} and errors == {1, 2} and "boom" in reasons["x"]


def test_receiver_wait_layer() -> None:
    rx = LayerReceiver(2, first_layer_timeout_s=5.0, layer_timeout_s=5.0)
    rx.expect(RecvReqMeta(request_id="w", transfer_id="w", block_ids=[[1]]))
    threading.Timer(
        0.05, rx.on_layer_done, args=(LayerDone(sender="p", layers=[0], request_ids=["w"], trans_count=1),)
    ).start()
    rx.wait_layer(0, ["w"], 2.0)
    with pytest.raises(DeadlineExceeded):
        rx.wait_layer(1, ["w"], 0.1)


# ---- scheduler ------------------------------------------------------------------------------------------


def test_d_scheduler_announces_all_blocks_and_p_scheduler_tracks_chunks() -> None:
    ms = CollectingMetaserver()
    d = LayerwiseScheduler(_cfg(), [16], metaserver=ms)
    req = SchedRequest("r", 70, {"do_remote_prefill": True, "metaserver": "http://x/v1/metaserver"})
    assert d.get_num_new_matched_tokens(req, 16) == (54, True)
    with pytest.raises(ConfigError):
        d.get_num_new_matched_tokens(req, 5)
    d.update_state_after_alloc(req, [[1, 2, 3, 4, 5]], 54)
    posted = ms.take("r")
    assert posted["remote_block_ids"] == [[1, 2, 3, 4, 5]] and posted["remote_cached_tokens"] == 16
    assert posted["remote_port"] == 40000 and req.kv_transfer_params == {
        **req.kv_transfer_params,
        "do_remote_prefill": False,
    }
    meta = d.build_connector_meta()
    assert [m.request_id for m in meta.recv] == ["r"] and not meta.recv[0].failed
    d.request_finished(req, [[1, 2, 3, 4, 5]])
    d.close()
    assert d.tracked == 0

    p = LayerwiseScheduler(_cfg("kv_producer"), [16])
    preq = SchedRequest("r", 70, {**posted, "do_remote_decode": True})
    p.update_state_after_alloc(preq, [[9, 8, 7, 6, 5]], 0)
    first = p.build_connector_meta({"r": Scheduled(0, 40)}).send[0]
    assert (first.transed_tokens, first.computed_tokens, first.chunk_finished) == (16, 40, False)
    second = p.build_connector_meta({"r": Scheduled(40, 30)}).send[0]
    assert (second.transed_tokens, second.computed_tokens, second.chunk_finished) == (32, 70, True)
    assert p.build_connector_meta({"r": Scheduled(70, 1)}).send == [] and p.tracked == 0


def test_p_scheduler_hands_an_early_end_to_the_workers_once() -> None:
    """A push that ends on P before its last chunk is named in the next step's ``ended`` (the workers
    tell D it failed); one that finished, or never got a step (nothing written), is not."""
    ms = CollectingMetaserver()
    d = LayerwiseScheduler(_cfg(), [16], metaserver=ms)
    for rid in ("a", "b", "c"):
        d.update_state_after_alloc(
            SchedRequest(rid, 70, {"do_remote_prefill": True, "metaserver": "http://x"}), [[1]], 70
        )
    posted = {rid: ms.take(rid) for rid in ("a", "b", "c")}
    d.close()
    p = LayerwiseScheduler(_cfg("kv_producer"), [16])
    reqs = {rid: SchedRequest(rid, 70, {**posted[rid], "do_remote_decode": True}) for rid in posted}
    for req in reqs.values():
        p.update_state_after_alloc(req, [[9, 8, 7, 6, 5]], 0)
    meta = p.build_connector_meta({"a": Scheduled(0, 40), "b": Scheduled(0, 70)})
    assert meta.ended == [] and [m.chunk_finished for m in meta.send] == [False, True]
    for req in reqs.values():  # a: aborted after its first chunk; b: finished; c: never scheduled
        p.request_finished(req, [[9, 8, 7, 6, 5]])
    assert p.build_connector_meta({}).ended == ["a"]
    assert p.build_connector_meta({}).ended == [] and p.tracked == 0


def test_d_scheduler_query_is_pure() -> None:
    """Asked twice before allocation: same answer, no announcement, nothing tracked."""
    ms = CollectingMetaserver()
    d = LayerwiseScheduler(_cfg(), [16], metaserver=ms)
    req = SchedRequest("r", 70, {"do_remote_prefill": True, "metaserver": "http://x/v1/metaserver"})
    before = dict(req.kv_transfer_params or {})
    assert [d.get_num_new_matched_tokens(req, 16) for _ in range(2)] == [(54, True)] * 2
    assert req.kv_transfer_params == before and d.tracked == 0
    assert d.build_connector_meta().recv == []
    d.close()


def test_d_scheduler_without_metaserver_fails_the_request_not_the_engine() -> None:
    d = LayerwiseScheduler(_cfg(), [16], metaserver=CollectingMetaserver())
    req = SchedRequest("r", 20, {"do_remote_prefill": True})
    d.get_num_new_matched_tokens(req, 0)
    d.update_state_after_alloc(req, [[3, 4]], 20)
    metas = d.build_connector_meta().recv
    assert [(m.request_id, bool(m.failed), m.block_ids) for m in metas] == [
        ("r", False, [[3, 4]]),
        ("r", True, [[3, 4]]),
    ]
    assert "metaserver" in metas[1].failed
    d.close()


# ---- wire -----------------------------------------------------------------------------------------------


def test_codec_refuses_garbage_and_params_name_the_key() -> None:
    codec = request_codec(1024)
    with pytest.raises(ProtocolError):
        codec.decode(b"\x93\x01\x02")
    with pytest.raises(ProtocolError):
        codec.decode(b"x" * 2048)
    ok = {"request_id": "r", "remote_engine_id": "d", "remote_host": "h", "remote_port": 9, "remote_block_ids": [[1]]}
    assert parse_push_params(ok).remote_port == 9
    for key, bad in [
        ("remote_port", "x"),
        ("remote_port", 70000),
        ("remote_block_ids", [[-1]]),
        ("protocol_version", 9),
    ]:
        with pytest.raises(ConfigError) as info:
            parse_push_params({**ok, key: bad})
        assert info.value.field == f"kv_transfer_params.{key}"
    with pytest.raises(ConfigError) as info:
        parse_push_params({k: v for k, v in ok.items() if k != "remote_host"})
    assert info.value.field == "kv_transfer_params.remote_host"


def test_external_request_id_drops_only_vllms_suffix() -> None:
    from ascend_dist.kv_mooncake.push.messages import external_request_id

    assert external_request_id("chatcmpl-abc-0123abcd") == "chatcmpl-abc"
    assert external_request_id("cmpl-1") == "cmpl-1"  # no suffix (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)
    assert external_request_id("req-0123ABCD") == "req-0123ABCD"  # not vLLM's lower-case hex


class _NoWrites:
    """Our `Writer` Protocol for a send thread that is never given a layer."""

    session = "127.0.0.1:1"

    def register(self, regions: Any) -> None:
        pass

    def unregister(self, regions: Any) -> None:
        pass

    def write(self, session: str, pieces: Any, *, timeout_s: float = 60.0) -> None:
        raise AssertionError("no layer was queued")


def test_send_thread_failure_memory_is_bounded() -> None:
    """Failures of requests that never reach their last layer (aborted on P) used to stay forever."""
    from ascend_dist.common.zmq_rpc import RpcClient
    from ascend_dist.kv_mooncake.push.messages import CHANNEL, reply_codec
    from ascend_dist.kv_mooncake.push.sender import FAILED_MEMORY, MetaCache, SendThread

    client = RpcClient(timeout_s=1.0)
    requests, replies = request_codec(1 << 20), reply_codec(1 << 20)
    metas = MetaCache(client, requests, replies, CHANNEL.handshake(sender="p"), "P")
    thread = SendThread(
        _NoWrites(),
        client=client,
        requests=requests,
        replies=replies,
        gate=ReuseGate({0: [0]}, alive=lambda: True),
        metas=metas,
        sender="p",
        transfer_timeout_s=1.0,
    )
    try:
        for i in range(FAILED_MEMORY + 100):
            thread.mark_failed(f"r{i}", "aborted")
        assert thread.failure("r0") is None  # the oldest were forgotten
        assert thread.failure(f"r{FAILED_MEMORY + 99}") == "aborted"
        assert len(thread._failed) == FAILED_MEMORY
    finally:
        thread.close()
        client.close()
