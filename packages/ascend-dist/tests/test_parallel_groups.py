import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.parallel.groups import AscendGroupOptions, AscendProcessGroups, GroupNotInitialized
from ascend_dist.parallel.layout import ParallelLayout


class FakeCoordinator:
    def __init__(self, name, ranks):
        self.name = name
        self.ranks = ranks
        self.destroyed = 0

    def destroy(self):
        self.destroyed += 1


class RecordingFactory:
    def __init__(self, fail_on=None):
        self.made: list[FakeCoordinator] = []
        self.fail_on = fail_on

    def __call__(self, group_ranks, local_rank, backend, group_name):
        if group_name == self.fail_on:
            raise RuntimeError(f"cannot create {group_name}")
        coordinator = FakeCoordinator(group_name, group_ranks)
        self.made.append(coordinator)
        return coordinator


LAYOUT = ParallelLayout(16, tp=4, dp=2, pp=2)
ALL_ON = AscendGroupOptions(
    pd_tp_ratio=2, pd_head_ratio=2, is_kv_producer=True, dynamic_eplb=True,
    oproj_tp_size=2, lmhead_tp_size=2, embedding_tp_size=2, mlp_tp_size=2,
)  # fmt: skip


def _create(groups, options=ALL_ON, rank=5, factory=None):
    factory = factory or RecordingFactory()
    groups.create(LAYOUT, options, rank=rank, local_rank=rank % 8, backend="gloo", factory=factory)
    return factory


def test_creates_every_requested_group_and_shares_same_size_finegrained_groups():
    groups = AscendProcessGroups()
    factory = _create(groups)
    assert [c.name for c in factory.made] == ["p_tp_2", "mc2", "dynamic_eplb", "otp"]
    assert groups.get("otp") is groups.get("lmhead_tp") is groups.get("mlp_tp")


def test_p_tp_name_comes_from_the_global_rank():
    groups = AscendProcessGroups()
    factory = _create(groups, rank=13)
    assert factory.made[0].name == "p_tp_6"


def test_optional_groups_absent_unless_asked():
    groups = AscendProcessGroups()
    factory = _create(groups, options=AscendGroupOptions())
    assert [c.name for c in factory.made] == ["mc2"]
    with pytest.raises(GroupNotInitialized, match="p_tp"):
        groups.get("p_tp")


def test_destroy_destroys_each_coordinator_once_and_allows_recreation():
    groups = AscendProcessGroups()
    first = _create(groups)
    _create(groups)  # already initialized: nothing new
    groups.destroy()
    groups.destroy()
    assert all(c.destroyed == 1 for c in first.made)
    assert not groups.initialized
    second = _create(groups)
    assert len(second.made) == 4 and groups.initialized


def test_a_failed_creation_destroys_what_was_created():
    groups = AscendProcessGroups()
    factory = RecordingFactory(fail_on="dynamic_eplb")
    with pytest.raises(RuntimeError, match="dynamic_eplb"):
        _create(groups, factory=factory)
    assert all(c.destroyed == 1 for c in factory.made)
    assert not groups.initialized


def test_context_manager_destroys_on_error():
    factory = RecordingFactory()
    with pytest.raises(KeyError), AscendProcessGroups() as groups:
        _create(groups, factory=factory)
        raise KeyError("boom")
    assert all(c.destroyed == 1 for c in factory.made)


def test_bad_rank_and_slot_are_typed_errors():
    groups = AscendProcessGroups()
    with pytest.raises(ConfigError, match="rank"):
        _create(groups, rank=16)
    with pytest.raises(ConfigError, match="slot"):
        groups.get("tp")
