"""One rank of the gloo process-group test: `python gloo_groups_worker.py RANK WORLD PORT`.

Creates the Ascend groups over real gloo groups twice (destroying them in between), all-reduces the
rank inside each group, and prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ascend_dist.parallel.dist_utils import all_gather_async
from ascend_dist.parallel.groups import AscendGroupOptions, AscendProcessGroups
from ascend_dist.parallel.layout import ParallelLayout

OPTIONS = AscendGroupOptions(pd_tp_ratio=2, pd_head_ratio=2, is_kv_producer=True, oproj_tp_size=2)


class GlooCoordinator:
    """This rank's gloo group of one family, with vLLM's coordinator attributes and a real destroy."""

    def __init__(self, group_ranks: list[list[int]]) -> None:
        me = dist.get_rank()
        for ranks in group_ranks:  # every rank creates every group, in the same order
            group = dist.new_group(ranks, backend="gloo")
            if me in ranks:
                self.device_group, self.ranks = group, ranks
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(me)

    def destroy(self) -> None:
        dist.destroy_process_group(self.device_group)


def gloo_factory(group_ranks: list[list[int]], local_rank: int, backend: str, group_name: str) -> GlooCoordinator:
    return GlooCoordinator(group_ranks)


def member_sum(coordinator: GlooCoordinator) -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=coordinator.device_group)
    return t.item()


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=30)
    )
    layout = ParallelLayout(world, tp=2, dp=world // 2)
    groups = AscendProcessGroups()
    rounds = []
    for _ in range(2):  # create, use, destroy; then again in the same process
        with groups:
            groups.create(layout, OPTIONS, rank=rank, local_rank=rank, backend="gloo", factory=gloo_factory)
            rounds.append({slot: member_sum(groups.get(slot)) for slot in ("mc2", "p_tp", "otp")})  # type: ignore[arg-type]
        assert not groups.initialized
    mc2_like = GlooCoordinator([list(range(world))])
    gathered, work = all_gather_async(torch.tensor([rank, rank]), mc2_like)
    assert work is not None
    work.wait()
    print(json.dumps({"rank": rank, "rounds": rounds, "gathered": gathered.tolist()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
