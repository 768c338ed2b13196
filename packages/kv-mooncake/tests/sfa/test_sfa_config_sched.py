"""Configuration, wire and scheduler halves of the SFA connector (no processes)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ascend_dist.common.errors import ConfigError, DeviceUnavailable, IncompatiblePeer, ProtocolError
from ascend_dist.common.wire import check_compatible
from ascend_dist.kv_mooncake.core.memfabric import MemfabricEngine
from ascend_dist.kv_mooncake.sfa.backend import make_backend
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.messages import (
    ContactInfo,
    ReadDone,
    ReadReady,
    ReadReq,
    parse_contact,
    reply_codec,
    request_codec,
)
from ascend_dist.kv_mooncake.sfa.plan import GroupIds
from ascend_dist.kv_mooncake.sfa.producer import make_sfa_handshake
from ascend_dist.kv_mooncake.sfa.scheduler import (
    ConsumerScheduler,
    ProducerScheduler,
    SfaRequest,
    StepRequest,
)

_BASE: dict[str, Any] = {
    "prefill": {"tp_size": 4},
    "decode": {"tp_size": 2, "dp_size": 2},
    "transfer_backend": "mooncake",
}


def _cfg(role: str = "kv_consumer", kv_port: object = 40000, **extra: Any) -> SfaConfig:
    return SfaConfig.from_kv_transfer_config(
        engine_id="e0", kv_role=role, kv_port=kv_port, extra={**_BASE, **extra}, model="m", dtype="bf16"
    )


def test_ports_use_the_global_dp_rank() -> None:
    assert _cfg(dp_rank=1).d_base_port == 40002
    assert _cfg().tp_ratio == 2


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"prefill": {"tp_size": 1}}, "prefill.tp_size"),
        ({"prefill": {"tp_size": 3}}, "prefill.tp_size"),
        ({"transfer_backend": "nccl"}, "transfer_backend"),
        ({"use_layerwise": False}, "use_layerwise"),
        ({"use_layerwise": "yes"}, "use_layerwise"),
        ({"read_timeout_s": 0}, "read_timeout_s"),
        ({"host": "0.0.0.0"}, "host"),
        ({"dp_rank": 2}, "dp_rank"),
        ({"mooncake_protocol": "udp"}, "mooncake_protocol"),
        ({"kv_port": 65534}, "kv_port"),
    ],
)
def test_invalid_config_names_the_field(kw: dict[str, Any], field: str) -> None:
    kv_port = kw.pop("kv_port", 40000)
    with pytest.raises(ConfigError, match=field):
        _cfg(kv_port=kv_port, **kw)


def test_missing_topology_and_role() -> None:
    with pytest.raises(ConfigError, match="kv_role"):
        SfaConfig.from_kv_transfer_config(engine_id="e", kv_role="kv_both", kv_port=1, extra=_BASE)
    with pytest.raises(ConfigError, match="decode"):
        SfaConfig.from_kv_transfer_config(
            engine_id="e", kv_role="kv_producer", kv_port=1, extra={"prefill": {"tp_size": 1}}
        )


def test_contact_params_are_validated_by_key() -> None:
    good = {"request_id": "r", "remote_engine_id": "d", "remote_host": "h", "remote_port": 5, "remote_tp_size": 1}
    assert parse_contact(good).remote_port == 5
    with pytest.raises(ConfigError, match=r"kv_transfer_params.remote_port"):
        parse_contact({**good, "remote_port": "x"})
    with pytest.raises(ConfigError, match=r"kv_transfer_params.remote_port"):
        parse_contact({**good, "remote_port": 70000})
    with pytest.raises(ConfigError, match="request_id"):
        parse_contact({k: v for k, v in good.items() if k != "request_id"})


def test_wire_round_trip_and_strict_decoding() -> None:
    codec = request_codec(1 << 20)
    msg = ReadReady(sender="p/tp0", layer_idx=2, layer_name="l", reads=[ReadReq("r", [1, 2], [3], 4, 4)])
    assert codec.decode(codec.encode(msg)) == msg
    with pytest.raises(ProtocolError):
        codec.decode(msgspec.msgpack.encode({"kind": "read_ready", "layer_idx": "two"}))
    # an older peer's ReadDone without the optional field still decodes
    assert reply_codec(1024).decode(msgspec.msgpack.encode({"kind": "read_done", "layer_idx": 1})) == ReadDone(
        layer_idx=1
    )


def test_handshake_mismatch_names_the_field() -> None:
    a = make_sfa_handshake(_cfg(), "a", 4)
    b = make_sfa_handshake(_cfg(prefill={"tp_size": 2}), "b", 4)
    with pytest.raises(IncompatiblePeer, match="prefill_tp"):
        check_compatible(a, b)


class _Sink:
    def __init__(self) -> None:
        self.posted: list[tuple[str, ContactInfo]] = []
        self.cancelled: list[str] = []

    def post(self, ext_id: str, contact: ContactInfo, url: str | None = None) -> None:
        self.posted.append((ext_id, contact))

    def cancel(self, ext_id: str) -> None:
        self.cancelled.append(ext_id)


def test_consumer_scheduler_lifecycle() -> None:
    sink = _Sink()
    sched = ConsumerScheduler(_cfg(dp_rank=1), [16, 16], GroupIds(0, 1), sink)
    plain = SfaRequest("a", "a", 40, None)
    assert sched.get_num_new_matched_tokens(plain, 0) == (0, False)
    req = SfaRequest("r-1", "r", 40, {"do_remote_prefill": True})
    assert sched.get_num_new_matched_tokens(req, 16) == (24, True)
    with pytest.raises(ConfigError, match="num_computed_tokens"):
        sched.get_num_new_matched_tokens(req, 5)
    contact = sched.update_state_after_alloc(req, [[1, 2, 3], [7, 8, 9]], 24, 16)
    assert contact is not None and contact.remote_port == 40002 and contact.remote_cached_tokens == 16
    assert req.kv_transfer_params == {"do_remote_prefill": False}
    assert sink.posted == [("r", contact)]
    meta = sched.build_connector_meta()
    assert [(r.main_block_ids, r.indexer_block_ids) for r in meta.requests] == [((1, 2, 3), (7, 8, 9))]
    assert sched.build_connector_meta().requests == ()
    assert sched.request_finished(req) == (False, None)
    assert sink.cancelled == ["r"] and sched.tracked == 0
    virtual = SfaRequest("v", "v", 16, {"do_remote_prefill": True, "do_virtual": True})
    sched.update_state_after_alloc(virtual, [[1], [2]], 16, 0)
    assert len(sink.posted) == 1


def _contact(**kw: Any) -> dict[str, Any]:
    return {"request_id": "r", "remote_engine_id": "d", "remote_host": "h", "remote_port": 9, "remote_tp_size": 1, **kw}


def test_producer_scheduler_chunks() -> None:
    sched = ProducerScheduler(_cfg("kv_producer"), [16, 16], GroupIds(0, 1))
    req = SfaRequest("p-1", "r", 40, {"do_remote_decode": True, **_contact(remote_cached_tokens=16)})
    sched.update_state_after_alloc(req)
    m1 = sched.build_connector_meta([StepRequest("p-1", 0, 20, ((1, 2), (5, 6)), is_new=True)])
    (a,) = m1.requests
    assert (a.computed_tokens, a.transferred_tokens, a.cached_tokens, a.chunk_finish) == (20, 0, 16, False)
    m2 = sched.build_connector_meta([StepRequest("p-1", 20, 20, ((3,), (7,)))])
    (b,) = m2.requests
    assert b.main_block_ids == (1, 2, 3) and b.indexer_block_ids == (5, 6, 7)
    assert (b.computed_tokens, b.transferred_tokens, b.chunk_finish) == (40, 16, True)
    assert sched.tracked == 0


def test_producer_batch_params_resolve_per_child() -> None:
    sched = ProducerScheduler(_cfg("kv_producer"), [16, 16], GroupIds(0, 1))
    batch = {"c-1": _contact(request_id="c-1"), "c-2": _contact(request_id="c-2", remote_port=11)}
    sched.update_state_after_alloc(
        SfaRequest("x", "c-2", 16, {"do_remote_decode": True, "batch_kv_transfer_params": batch})
    )
    (s,) = sched.build_connector_meta([StepRequest("x", 0, 16, ((1,), (2,)), is_new=True)]).requests
    assert s.ext_id == "c-2" and s.d_base_port == 11
    with pytest.raises(ConfigError, match="batch_kv_transfer_params"):
        sched.update_state_after_alloc(
            SfaRequest("y", "c-3", 16, {"do_remote_decode": True, "batch_kv_transfer_params": batch})
        )


def test_memfabric_without_the_ascend_driver_says_what_is_missing() -> None:
    with pytest.raises(DeviceUnavailable, match="transfer_backend='mooncake'"):
        MemfabricEngine("127.0.0.1", "Decode", 0)
    with pytest.raises(DeviceUnavailable):
        make_backend("memfabric", "127.0.0.1")
    with pytest.raises(ConfigError, match="role"):
        MemfabricEngine("127.0.0.1", "Both", 0)
    with pytest.raises(ConfigError, match="transfer_backend"):
        make_backend("gloo", "127.0.0.1")
