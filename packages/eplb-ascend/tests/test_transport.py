"""Transport and queue: validation with a fake transport; real gloo subgroups and the device seam."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ascend_dist.common.errors import ConfigError, TransferError
from ascend_dist.eplb_ascend._demo.launch import run_ranks
from ascend_dist.eplb_ascend.communicator import ExpertTransferQueue
from ascend_dist.eplb_ascend.transport import DeviceCollectiveTransport, GlooTransport, P2POperation, P2PTransport


class RecordingTransport:
    """A `P2PTransport` of our own: records batches, optionally fails them."""

    rank, world_size = 1, 3

    def __init__(self, fail=False):
        self.fail = fail
        self.batches = []

    def batch_send_recv(self, ops, timeout_s):
        self.batches.append(list(ops))
        if self.fail:
            raise TransferError("peer closed")

    def all_gather_int64(self, values, timeout_s):
        return values.reshape(1, -1).repeat(self.world_size, 1)


def test_queue_tags_pair_by_expert_and_validates_input():
    transport = RecordingTransport()
    assert isinstance(transport, P2PTransport)
    queue = ExpertTransferQueue(transport)
    a, b = torch.ones(3), torch.ones(2)
    queue.add_send([a, b], dst_rank=2, expert_id=5)
    queue.add_recv([torch.empty(3), torch.empty(2)], src_rank=0, expert_id=7)
    queue.execute()
    ops = transport.batches[0]
    assert [(o.kind, o.peer, o.tag) for o in ops] == [
        ("send", 2, 10),
        ("send", 2, 11),
        ("recv", 0, 14),
        ("recv", 0, 15),
    ]
    assert ops[0].tensor is a and queue.pending == 0
    for bad in ({"dst_rank": 1}, {"dst_rank": 3}, {"dst_rank": -1}):
        with pytest.raises(ConfigError, match="dst_rank"):
            queue.add_send([a], expert_id=0, **bad)
    with pytest.raises(ConfigError, match="expert_id"):
        queue.add_send([a], dst_rank=0, expert_id=-1)
    with pytest.raises(ConfigError, match="contiguous"):
        queue.add_recv([torch.ones(4, 4).t()], src_rank=0, expert_id=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        ExpertTransferQueue(transport, timeout_s=0)


def test_queue_is_cleared_when_the_batch_fails():
    transport = RecordingTransport(fail=True)
    queue = ExpertTransferQueue(transport)
    queue.add_send([torch.ones(2)], dst_rank=0, expert_id=1)
    with pytest.raises(TransferError):
        queue.execute()
    assert queue.pending == 0


class GlooPointToPoint:
    """A `PointToPointCommunicator` over gloo, shaped like vLLM's PyNccl: ops queued between group start/end."""

    def __init__(self, group):
        self.group, self.rank, self.world_size = group, dist.get_rank(group), dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.works, self.queued = [], None

    def group_start(self):
        self.queued = []

    def send(self, tensor, dst, stream=None):
        self.queued.append((dist.isend, tensor, dst))

    def recv(self, tensor, src, stream=None):
        self.queued.append((dist.irecv, tensor, src))

    def group_end(self):
        self.works = [fn(t, self.ranks[peer], group=self.group) for fn, t, peer in self.queued]

    def synchronize(self, timeout_s):
        for w in self.works:
            w.wait(timeout=timedelta(seconds=timeout_s))


def _subgroup_rank(cfg):
    rank = cfg["rank"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=cfg["world"],
                            timeout=timedelta(seconds=30))  # fmt: skip
    try:
        group = dist.new_group([1, 2], backend="gloo")  # every rank creates it; ranks 1 and 2 use it
        if rank == 0:
            return {"rank": rank}
        transport = GlooTransport(group)  # group-local 0/1 are global 1/2
        peer = 1 - transport.rank
        mine, theirs = torch.full((5,), float(rank)), torch.empty(5)
        transport.batch_send_recv([P2POperation("send", mine, peer, 3), P2POperation("recv", theirs, peer, 3)], 10)
        gathered = transport.all_gather_int64(torch.tensor([rank, 7]), 10).tolist()
        comm = GlooPointToPoint(group)
        device = DeviceCollectiveTransport(comm, transport, comm.synchronize)
        back = torch.empty(5)
        device.batch_send_recv([P2POperation("send", theirs, peer), P2POperation("recv", back, peer)], 10)
        try:
            device.batch_send_recv([P2POperation("send", torch.ones(2, 4)[1], peer)], 10)
            offset_refused = False
        except ConfigError:
            offset_refused = True
        return {"rank": rank, "local": transport.rank, "global_of_peer": transport.global_rank(peer),
                "got": theirs.tolist(), "gathered": gathered, "back": back.tolist(),
                "offset_refused": offset_refused}  # fmt: skip
    finally:
        dist.destroy_process_group()


def test_gloo_subgroup_maps_local_ranks_to_global_and_the_device_seam_moves_bytes():
    seen = run_ranks(_subgroup_rank, {}, world=3, timeout_s=60)
    one, two = seen[1], seen[2]
    assert (one["local"], one["global_of_peer"]) == (0, 2) and (two["local"], two["global_of_peer"]) == (1, 1)
    assert one["got"] == [2.0] * 5 and two["got"] == [1.0] * 5
    assert one["gathered"] == two["gathered"] == [[1, 7], [2, 7]]
    assert one["back"] == [1.0] * 5 and two["back"] == [2.0] * 5  # sent back what each received
    assert one["offset_refused"] and two["offset_refused"]


def test_gloo_transport_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(ConfigError, match=r"torch\.distributed"):
        GlooTransport()
