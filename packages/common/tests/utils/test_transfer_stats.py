"""The vLLM-free transfer-stats recorder: records, snapshot-and-reset, failure kinds, the builtins form."""

from __future__ import annotations

import json
import threading

import pytest

from ascend_dist.common.errors import (
    DeadlineExceeded,
    IncompatiblePeer,
    LeaseExpired,
    PeerUnreachable,
    ProtocolError,
    TransferError,
    TransferRefused,
    TransferTimeout,
)
from ascend_dist.common.transfer_stats import (
    FailureKind,
    StatsData,
    TransferStats,
    classify_failure,
    from_builtins,
    merge,
    summarize,
    to_builtins,
)


def test_a_recorder_that_saw_nothing_hands_out_nothing() -> None:
    stats = TransferStats("p2p")
    assert stats.take() is None  # the control of every test below: no record, no payload


def test_transfers_failures_and_pool_tokens_are_taken_once() -> None:
    stats = TransferStats("pool")
    stats.record_transfer("load", 0.25, 4096, 3)
    stats.record_failure("save", TransferTimeout("slow"))
    stats.record_failure("save", FailureKind.TIMEOUT)
    stats.record_pool_lookup(hit_tokens=32, miss_tokens=8)
    data = stats.take()
    assert data is not None
    assert [(t.channel, t.direction, t.duration_s, t.nbytes, t.descriptors) for t in data.transfers] == [
        ("pool", "load", 0.25, 4096, 3)
    ]
    assert [(f.direction, f.kind, f.count) for f in data.failures] == [("save", FailureKind.TIMEOUT, 2)]
    assert (data.pool_hit_tokens, data.pool_miss_tokens) == (32, 8)
    assert stats.take() is None  # reset


def test_timed_records_a_transfer_or_a_classified_failure() -> None:
    stats = TransferStats("offload")
    with stats.timed("save", 100, 2):
        pass
    with pytest.raises(LeaseExpired), stats.timed("load", 100, 2):
        raise LeaseExpired("gone")
    data = stats.take()
    assert data is not None
    assert [(t.direction, t.nbytes) for t in data.transfers] == [("save", 100)]
    assert [(f.direction, f.kind) for f in data.failures] == [("load", FailureKind.LEASE_EXPIRED)]


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (LeaseExpired("x"), FailureKind.LEASE_EXPIRED),
        (PeerUnreachable("x"), FailureKind.PEER_UNREACHABLE),
        (ConnectionRefusedError(), FailureKind.PEER_UNREACHABLE),
        (TransferTimeout("x"), FailureKind.TIMEOUT),
        (DeadlineExceeded("x"), FailureKind.TIMEOUT),
        (TransferRefused("x"), FailureKind.REFUSED),
        (IncompatiblePeer("f", 1, 2), FailureKind.REFUSED),
        (TransferError("x"), FailureKind.OTHER),
        (RuntimeError("x"), FailureKind.OTHER),
    ],
)
def test_failure_kinds_come_from_the_error_types(exc: BaseException, kind: FailureKind) -> None:
    assert classify_failure(exc) is kind


def test_the_builtins_form_is_json_and_round_trips_and_merges() -> None:
    a, b = TransferStats("p2p"), TransferStats("p2p")
    a.record_transfer("load", 0.5, 1 << 20, 10)
    b.record_transfer("load", 1.5, 3 << 20, 30)
    b.record_failure("load", FailureKind.REFUSED)
    da, db = a.take(), b.take()
    assert da is not None and db is not None
    wire = json.loads(json.dumps(to_builtins(da)))
    merged = merge(from_builtins(wire), from_builtins(to_builtins(db)))
    summary = summarize(merged)
    assert summary["p2p load: Num successful transfers"] == 2
    assert summary["p2p load: MB transferred"] == 4.0
    assert summary["p2p load: Throughput (MB/s)"] == 2.0
    assert summary["p2p load: Avg number of descriptors"] == 20.0
    assert summary["p2p load: Num failed transfers (refused)"] == 1
    assert summarize(StatsData()) == {}


@pytest.mark.parametrize(
    "bad",
    [
        None,
        {"transfers": []},  # no schema marker
        {"ascend_dist_stats": 2},
        {"ascend_dist_stats": 1, "transfers": [["p2p", "load", 0.1, -5, 1]]},
        {"ascend_dist_stats": 1, "transfers": [["disk", "load", 0.1, 5, 1]]},
        {"ascend_dist_stats": 1, "failures": [["p2p", "load", "cosmic", 1]]},
    ],
)
def test_a_malformed_payload_is_a_typed_error(bad: object) -> None:
    with pytest.raises(ProtocolError):
        from_builtins(bad)


def test_concurrent_writers_lose_no_record() -> None:
    stats = TransferStats("p2p")
    taken: list[StatsData] = []

    def write() -> None:
        for _ in range(2000):
            stats.record_transfer("load", 0.001, 1, 1)
            stats.record_failure("load", FailureKind.OTHER)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if (d := stats.take()) is not None:
            taken.append(d)
    for t in threads:
        t.join()
    if (d := stats.take()) is not None:
        taken.append(d)
    assert sum(len(d.transfers) for d in taken) == 8000
    assert sum(f.count for d in taken for f in d.failures) == 8000
