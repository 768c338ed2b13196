"""P's send threads: every part is resolved once and every gate opens (reply, deadline or shutdown)."""

from __future__ import annotations

import time

from ascend_dist.common.wire import make_handshake
from ascend_dist.common.zmq_rpc import RpcServer
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake.pull.config import Role
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.links import Dispatcher, Part, Slot
from ascend_dist.kv_mooncake.sfa.messages import Hello, ReadReady, ReadReq


def _dispatcher(**extra: object) -> Dispatcher:
    cfg = SfaConfig.from_kv_transfer_config(
        engine_id="P",
        kv_role=Role.PRODUCER.value,
        kv_port=free_port_range(1),
        extra={"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "transfer_backend": "mooncake", **extra},
    )
    hello = Hello(handshake=make_handshake("x", 1), engine_id="P", sender="P/tp0", session="s:1", layers={})
    return Dispatcher(cfg, lambda: hello)


def _part(port: int, slot: Slot, layer: int) -> Part:
    msg = ReadReady(sender="P/tp0", layer_idx=layer, layer_name=f"l{layer}", reads=[ReadReq("r", [1], [])])
    return Part(("127.0.0.1", port), msg, [slot], ext_ids=["r"])


def test_shutdown_resolves_queued_parts_and_opens_the_gate() -> None:
    disp = _dispatcher(read_timeout_s=1.0, hello_timeout_s=1.0)
    slot = Slot()
    with RpcServer("127.0.0.1", 0, lambda payload: None, name="mute") as mute:
        for layer in range(3):
            disp.submit(_part(mute.port, slot, layer))
        assert not slot.event.is_set() and slot.pending == 3
        start = time.monotonic()
        disp.shutdown()
        assert time.monotonic() - start < 5.0
    assert slot.event.is_set() and slot.pending == 0 and slot.error is not None
    assert set(disp.take_failed()) == {"r"}  # marked failed once, whatever resolved it first
    assert not disp.links_alive()


def test_missed_deadline_marks_the_endpoint_down_and_later_parts_fail_at_once() -> None:
    disp = _dispatcher(read_timeout_s=0.5, hello_timeout_s=0.5, endpoint_retry_s=30.0)
    slot = Slot()
    try:
        with RpcServer("127.0.0.1", 0, lambda payload: None, name="mute") as mute:
            start = time.monotonic()
            for layer in range(5):
                disp.submit(_part(mute.port, slot, layer))
            assert slot.event.wait(5.0)
            assert time.monotonic() - start < 2.0  # one missed hello, not five deadlines
        failed = disp.take_failed()
        assert "DeadlineExceeded" in failed["r"]
    finally:
        disp.shutdown()
