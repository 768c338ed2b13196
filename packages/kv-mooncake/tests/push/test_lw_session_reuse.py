"""A layer-wise D restarted on a dead D's Mooncake RPC port, over real Mooncake TCP (D in child processes, P here).

P's Mooncake engine keeps a D's segment descriptor (its transport port) per session name
``host:rpc_port`` for the life of P's process and over TCP never refreshes it
(`core.session_owners`). A new D on the dead one's session but another transport port would be
written through the dead one's descriptor: to a port nobody listens on (each write fails after
Mooncake's reconnect attempts) or, worse, to whichever process took that port since. P must refuse
such a D's requests at once, without a write (vLLM recomputes them), and go on writing to every
other D through the same engine.

Mooncake draws both ports from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``; each D child is started
again until it drew the ports the case needs, and a start that drew others is stopped before
anything reached it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fault_engines import CountingWriter

from ascend_dist.common.errors import ProtocolError
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range, fresh_rpc_ports, wait_ports_released
from ascend_dist.kv_mooncake._demo.push_peer import LwPeerProcess
from ascend_dist.kv_mooncake._demo.push_synthetic import LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model
from ascend_dist.kv_mooncake.core.engine import get_engine
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig

SPEC = {"layers": 4, "heads": 4, "head_dim": 16, "block_size": 16, "num_blocks": 32}
PROMPT = 64  # 4 blocks of 16 tokens
TRIES = 30


class _D:
    """A D instance in a child process (its own Mooncake engine)."""

    def __init__(self, peer: LwPeerProcess, name: str, engine_id: str) -> None:
        self.peer, self.name = peer, name
        extra = {
            "engine_id": engine_id,
            "kv_port": free_port_range(1),
            "prefill": {"tp_size": 1},
            "decode": {"tp_size": 1},
            "rpc_timeout_s": 0.5,
            "rpc_retries": 2,
        }
        peer.call({"cmd": "create", "name": name, "role": "consumer", "config": extra, "model": SPEC}, timeout_s=60.0)

    def call(self, cmd: str, **fields: Any) -> dict[str, Any]:
        reply = self.peer.call({"cmd": cmd, "name": self.name, **fields}, timeout_s=60.0)
        assert "error" not in reply, reply
        return reply

    def mooncake_ports(self) -> tuple[int, int]:
        """``(RPC port, transport port)`` of its Mooncake engine."""
        reply = self.call("engine")
        (transport,) = reply["transport_ports"]
        return int(str(reply["session"]).rsplit(":", 1)[1]), int(transport)


@pytest.fixture
def p_here() -> Iterator[tuple[LwInstance, CountingWriter]]:
    """A P instance in this process, writing through this process's Mooncake engine (counted)."""
    engine = CountingWriter(get_engine("127.0.0.1", "tcp"))
    config = LayerwiseConfig.from_kv_transfer_config(
        engine_id="LWP-reuse",
        kv_role="kv_producer",
        kv_port=free_port_range(1),
        extra={"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}, "rpc_timeout_s": 0.5, "rpc_retries": 2},
        model="synthetic",
        dtype="int16",
    )
    p = LwInstance(config, Model(**SPEC), engine=engine)
    try:
        yield p, engine
    finally:
        p.shutdown()


def _push(p: LwInstance, d: _D, rid: str, seed: int) -> tuple[set[int], float]:
    """D announces ``rid``, P runs its forward (pushing each layer); D's load errors and the seconds to them."""
    params = d.call("announce", rid=rid, prompt_len=PROMPT)["params"]
    start = time.monotonic()
    p.prefill(params, PROMPT, seed)
    errors = set(d.call("wait_recv", rids=[rid], timeout_s=20.0)["errors"])
    return errors, time.monotonic() - start


def _start_drawing(window: range, wanted: Any, engine_id: str) -> tuple[LwPeerProcess, _D]:
    """A D child whose Mooncake ports, drawn from ``window``, satisfy ``wanted(rpc, transport)``."""
    drawn: list[tuple[int, int] | str] = []
    for _ in range(TRIES):
        peer = LwPeerProcess(rpc_ports=(window[0], window[-1]))
        try:
            d = _D(peer, "d", engine_id)
            drawn.append(d.mooncake_ports())
            if wanted(*drawn[-1]):
                return peer, d
        except (ProtocolError, AssertionError):  # Mooncake found no free transport port in the window
            drawn.append("no engine")
        peer.close()  # nothing reached it: its ports are free again at once
    raise AssertionError(f"no D drew the wanted Mooncake ports from {window} in {TRIES} starts: {drawn}")


@pytest.mark.timeout(300)
def test_a_d_restarted_on_a_dead_ds_mooncake_session_is_refused_at_once_and_others_are_written(
    p_here: tuple[LwInstance, CountingWriter],
) -> None:
    p, engine = p_here
    # Four ports of its own: the dead D draws the middle two, so a spare lies beside either of them.
    first, _ = fresh_rpc_ports()
    with LwPeerProcess(rpc_ports=(first + 1, first + 2)) as peer:
        dead = _D(peer, "d", "LWD-dead")
        assert _push(p, dead, "first", seed=1)[0] == set()
        assert dead.call("verify", rid="first", seed=1)["bytes"] > 0 and engine.writes > 0
        rpc, transport = dead.mooncake_ports()  # P's engine now keeps this descriptor for that session
        peer.kill()

    # The dead session on the spare port: P refuses at once and writes nothing. Connections P's
    # engine keeps to the dead D can hold its RPC port (the kernel's tcp_fin_timeout) until released.
    wait_ports_released([rpc])
    writes = engine.writes
    moved = range(first, first + 2) if rpc == first + 1 else range(first + 2, first + 4)
    peer, d = _start_drawing(moved, lambda r, t: r == rpc and t != transport, "LWD-moved")
    with peer:
        errors, took = _push(p, d, "moved", seed=2)
        assert errors == {b for group in d.call("blocks", rid="moved")["blocks"] for b in group}  # recomputed
        assert engine.writes == writes, "written through the dead D's descriptor"
        reason = d.call("reason", rid="moved")["reason"]
        assert f"Mooncake session 127.0.0.1:{rpc} now belongs to" in reason, reason  # this reason, no other
        assert took < 2.0, f"refusing took {took:.3f} s"
        assert _push(p, d, "again", seed=3)[0] != set()  # and stays refused: the descriptor is P's for good
        assert engine.writes == writes
        peer.kill()

    # Control: a D on a session of its own is written through the same engine, byte-exact.
    with LwPeerProcess() as peer:
        fresh = _D(peer, "d", "LWD-fresh")
        assert _push(p, fresh, "fresh", seed=4)[0] == set()
        assert fresh.call("verify", rid="fresh", seed=4)["bytes"] > 0 and engine.writes > writes
