"""The scenario contract of `ascend_dist.common.scenarios` that needs no installed scenario."""

from importlib.metadata import EntryPoint

from ascend_dist.common.scenarios import ENTRY_POINT_GROUP, Measurement, discover_scenarios


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=ENTRY_POINT_GROUP)


def test_an_entry_point_that_is_not_a_scenario_is_reported():
    found, broken = discover_scenarios([_ep("odd", "ascend_dist.common.errors:format_allowed")])
    assert not found
    assert "odd" in broken


def test_measurement_ratio_direction():
    faster = Measurement("t", 2.0, "ms", 40.0, "loop", higher_is_better=False, target_ratio=20)
    assert faster.ratio == 20.0 and faster.meets_target
    throughput = Measurement("bw", 1.0, "GB/s", 2.0, "raw engine")
    assert throughput.ratio == 0.5 and throughput.meets_target is None
