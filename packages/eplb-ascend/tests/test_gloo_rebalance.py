"""Real gloo groups across processes: a skewed-load rebalance, and the failure paths."""

BASE = {"num_layers": 2, "num_logical": 8, "num_physical": 12, "shapes": [[4, 8], [8]]}


def test_four_ranks_rebalance_moves_minimum_bytes_and_refreshes_tables_in_place(ranks):
    seen = ranks({**BASE, "mode": "rebalance"}, world=4)
    for s in seen:
        assert s["skip_when_quiet"] and s["fresh_anywhere"]  # no load anywhere -> skip; rank 0 only -> all go
        assert s["weights_ok"] and s["table_in_place"] and s["maps_in_place"] and s["table_values_ok"]
        assert s["placement_changed"] and s["hot_replicas"] >= 2 and s["queue_ok"]
        assert s["bytes_moved"] == s["bytes_minimum"] > 0


def test_failures_are_typed_within_the_deadline_and_keep_the_old_placement(ranks):
    seen = ranks({**BASE, "mode": "failures", "timeout_s": 1.5, "group_timeout_s": 20}, world=2)
    for s in seen:
        assert s["bad_placement"]["error"] == "PlacementError" and s["bad_placement"]["kept"]
        assert s["mismatch"]["error"] == "IncompatiblePeer" and s["mismatch"]["kept"]
    waiting = seen[0]["silent_peer"]
    assert waiting["error"] == "TransferTimeout" and waiting["kept"]
    assert 1.0 <= waiting["elapsed"] < 4.0
