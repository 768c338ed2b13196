"""Layer-wise pushes under faults, P in its own process: every request exact or failed whole, nothing left on D.

Waves of requests D announces and a P child (`_demo/push_peer.py`, JSON lines) pushes, with faults
in every wave: one request P never gets (D's first-layer deadline passes), one P aborts after its
first chunk (P's workers send D a failed `PushDone` behind its written layers and D reports it
failed at once), one D aborts before P pushes and one while P pushes (as vLLM does, D's scheduler
forgets it but its blocks stay allocated until the worker reports it); in four waves a slow
request whose forward stalls after layer 0 past D's layer deadline (D fences it; P's renewed claim
is refused, so it writes nothing more and sends a failed `PushDone`); and
``KV_MOONCAKE_LW_CHAOS_KILLS`` times P is SIGKILLed mid-batch, with layers in flight, and a new P
process starts with the same configuration. D steps (polls) all the while, as a decoding engine does.

Every request D reports is checked as it is reported: failed with all its blocks as load errors
(never a load error outside a failed request's blocks), or received with every byte P's pattern of
that request. D then writes its own bytes into a failed request's blocks (vLLM recomputes into
them) and checks them, and a received request's, once more before freeing the blocks; freed blocks
are reused first. Afterwards D holds no request record (receiver, scheduler, blocks, failure reasons
beyond their bound), its threads (native ones too), fds and registrations are at their steady size
apart from Mooncake's CLOSE_WAIT sockets to dead P sessions (counted apart, bounded), and the last P
holds nothing either. ``KV_MOONCAKE_LW_CHAOS_REQUESTS`` (default 480), ``KV_MOONCAKE_LW_CHAOS_SEED``
and ``KV_MOONCAKE_LW_CHAOS_SCALE`` (multiplies the deadlines, for slow machines) change the run.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.common.errors import DeadlineExceeded
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.push_peer import LwPeerProcess
from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver, LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.worker import FAILURE_REASONS_KEPT

REQUESTS = int(os.environ.get("KV_MOONCAKE_LW_CHAOS_REQUESTS", "480"))
KILLS = int(os.environ.get("KV_MOONCAKE_LW_CHAOS_KILLS", "2"))
SEED = int(os.environ.get("KV_MOONCAKE_LW_CHAOS_SEED", "24"))
SCALE = float(os.environ.get("KV_MOONCAKE_LW_CHAOS_SCALE", "1"))
WAVE = 40
BATCH = 20  # D announces a batch just before P gets it (as a proxy paces requests)
PROMPT = 32  # two blocks
RECOMPUTED = 1_000_000  # seed offset of the bytes D writes into a failed request's blocks
MAX_PENDING = 40  # failing requests D may still hold (deadlines running) before the next wave starts
FIRST_S, LAYER_S, FENCE_S = 3.0 * SCALE, 2.0 * SCALE, 1.5 * SCALE
SHAPE: dict[str, Any] = {"layers": 3, "heads": 2, "head_dim": 8, "block_size": 16}
SPAN = 2 * (FIRST_S + LAYER_S + FENCE_S) + 30.0  # longest a request may take to be reported


def _fd_names() -> set[str]:
    names = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            names.add(f"{fd.name}:{os.readlink(fd)}")
        except OSError:  # closed meanwhile (the listing's own fd)
            continue
    return names


def _tcp_sockets() -> dict[str, tuple[str, str]]:
    """This process's TCP sockets by inode: ``(local->remote, state)`` (state 08 is CLOSE_WAIT)."""
    out: dict[str, tuple[str, str]] = {}
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            out[cols[9]] = (f"{cols[1]}->{cols[2]}", cols[3])
    return out


def _inode(fd_name: str) -> str:
    target = fd_name.split(":", 1)[1]
    return target[len("socket:[") : -1] if target.startswith("socket:[") else ""


def _describe(new_fds: set[str]) -> str:
    tcp = _tcp_sockets()
    return f"{len(new_fds)} new fds: {[f'{n} {tcp.get(_inode(n), ())}' for n in sorted(new_fds)]}"


def _tasks() -> int:
    """Every thread of this process, native ones (Mooncake's) included."""
    return len(os.listdir("/proc/self/task"))


class _D:
    """D in this process: what it reported, checked as it is reported; blocks freed as vLLM frees them."""

    def __init__(self, inst: LwInstance) -> None:
        self.inst = inst
        self.worker = inst.ranks[0].worker
        self.expect: dict[str, str] = {}  # announced, not reported yet: "ok", "failed" or "any"
        self.seeds: dict[str, int] = {}
        self.aborted: set[str] = set()  # D's scheduler forgot them; their blocks wait for the report
        self.received: set[str] = set()  # reported received and verified; freed at the wave's end
        self.recomputed: set[str] = set()  # reported failed, D wrote its own bytes; checked at the wave's end
        self.counts: Counter[str] = Counter()

    def announce(self, rid: str, seed: int, expect: str) -> None:
        self.inst.announce(rid, PROMPT)
        self.expect[rid], self.seeds[rid] = expect, seed

    def abort(self, rid: str) -> None:
        """The client went away: D's scheduler forgets it; vLLM keeps its blocks until the worker reports it."""
        self.inst.scheduler.request_finished(self.inst.requests[rid], self.inst.blocks[rid])
        self.aborted.add(rid)

    def poll(self) -> set[str]:
        """One vLLM step's report, checked; returns the requests reported."""
        done, errors = self.inst.poll()
        failed = self.worker.take_failed()
        assert failed <= done, f"failed but not finished: {sorted(failed - done)[:4]}"
        failed_blocks: set[int] = set()
        for rid in failed:
            blocks = {b for ids in self.inst.blocks[rid] for b in ids}
            assert blocks <= errors, f"{rid} failed in part: {sorted(blocks - errors)} not reported"
            failed_blocks |= blocks
        stray = sorted(errors - failed_blocks)
        assert not stray, f"load errors outside the failed requests' blocks: {stray}"
        for rid in done:
            want = self.expect.pop(rid)  # KeyError: reported twice, or never announced
            if rid in failed:
                reason = self.worker.failure_reasons.get(rid)
                assert want != "ok", f"{rid} failed without a fault: {reason}"
                # P tells D at once; not D's deadline, then its fence's timeout with a "claimant" that never ends
                assert want != "failed_on_p" or "ended on P" in str(reason), f"{rid}: {reason}"
                self.counts["failed"] += 1
                if rid in self.aborted:
                    self.free(rid)
                else:  # vLLM recomputes into the same blocks: no write of P may land there any more
                    self.inst.recompute(rid, RECOMPUTED + self.seeds[rid])
                    self.recomputed.add(rid)
            else:
                assert want not in ("failed", "failed_on_p"), f"{rid} reported received, its push could not complete"
                assert self.inst.verify(rid, seed=self.seeds[rid]) > 0
                self.counts["received"] += 1
                self.received.add(rid)
        return done

    def wait(self, rids: set[str], timeout_s: float = SPAN) -> None:
        deadline = time.monotonic() + timeout_s
        while rids & self.expect.keys():
            assert time.monotonic() < deadline, f"{sorted(rids & self.expect.keys())[:4]} not reported in {timeout_s} s"
            self.poll()
            time.sleep(0.005)

    def wait_pending(self, below: int) -> None:
        deadline = time.monotonic() + SPAN
        while len(self.expect) >= below:
            assert time.monotonic() < deadline, f"{sorted(self.expect)[:4]} not reported in {SPAN} s"
            self.poll()
            time.sleep(0.01)

    def free_received(self) -> None:
        """The wave's requests decoded: verify once more (no late write landed), then free their blocks."""
        for rid in sorted(self.received):
            assert self.inst.verify(rid, seed=self.seeds[rid]) > 0
            self.free(rid)
        for rid in sorted(self.recomputed):
            try:
                self.inst.verify(rid, seed=RECOMPUTED + self.seeds[rid])
            except AssertionError as exc:
                raise AssertionError(f"P wrote into {rid}'s blocks after D reported it failed: {exc}") from None
            self.free(rid)
        self.received.clear()
        self.recomputed.clear()

    def free(self, rid: str) -> None:
        """vLLM frees the blocks; they go first in line (the next allocation reuses them)."""
        ids = self.inst.blocks.get(rid, [])
        if rid in self.aborted:
            self.aborted.discard(rid)
            self.inst.release(rid)
        else:
            self.inst.finish(rid)
        for free, group in zip(self.inst.free, ids, strict=True):
            if group:
                del free[-len(group) :]
                free[:0] = group


def _start_p(extra: dict[str, Any]) -> LwPeerProcess:
    peer = LwPeerProcess()
    try:
        peer.call({"cmd": "create", "name": "p", "config": extra, "model": {**SHAPE, "num_blocks": 64}}, timeout_s=60)
    except BaseException:
        peer.close()
        raise
    return peer


def _held(peer: LwPeerProcess) -> dict[str, int]:
    return {k: int(v) for k, v in peer.call({"cmd": "held", "name": "p"}, timeout_s=90.0).items()}


_EXPECT = {"ok": "ok", "never": "failed", "p_abort": "failed_on_p", "slow": "failed"}  # else "any" (D aborted)


class _Chaos:
    """The driver: D (`_D`), the P child it restarts after each kill, the proxy's metaserver."""

    def __init__(self, d: _D, metaserver: CollectingMetaserver, extra: dict[str, Any], rng: random.Random) -> None:
        self.d, self.ms, self.extra, self.rng = d, metaserver, extra, rng
        self.peer = _start_p(extra)
        self.kills: list[tuple[int, int]] = []  # (wave, batch) of each kill
        self.seed = 0
        self.p_base: dict[str, int] = {}  # the current P's steady size (after its first whole wave)

    def batch(self, rids: list[str], kinds: dict[str, str], *, kill: bool) -> set[str]:
        """Announce ``rids`` on D and have P push them (faults per ``kinds``); returns the ones that must arrive."""
        must: set[str] = set()
        items = []
        for rid in rids:
            kind = kinds.get(rid, "ok")
            want = _EXPECT.get(kind, "any")
            want = "any" if kill and want == "ok" else "failed" if kill and want == "failed_on_p" else want
            self.seed += 1
            self.d.announce(rid, self.seed, want)
            if want == "ok":
                must.add(rid)
            params = self.ms.take(rid)
            self.d.counts[kind] += 1
            if kind == "never":  # the proxy never reaches P with it
                continue
            if kind == "d_before":
                self.d.abort(rid)
            item: dict[str, Any] = {"params": params, "prompt_len": PROMPT, "seed": self.seed}
            if kind == "p_abort":  # the client goes away on P after the first of two chunks
                item |= {"chunks": 2, "abort_after": 1}
            if kind == "slow":  # its next layer comes after D's layer deadline
                item["pause_s"] = LAYER_S + 0.5
            if kill:
                item["compute_s"] = 0.01  # P is inside the batch when it dies
            items.append(item)
        self.peer.send({"cmd": "prefill_many", "name": "p", "items": items})
        for rid in rids:
            if kinds.get(rid) == "d_during":  # while P pushes it (or is about to)
                time.sleep(self.rng.uniform(0.0, 0.01))
                self.d.abort(rid)
        if kill:
            self.kill_midway(rids)
        else:
            self.await_reply(60.0 + 4 * LAYER_S)
        self.d.poll()
        return must

    def await_reply(self, timeout_s: float) -> None:
        """Wait for P's reply while D keeps stepping (as a decoding vLLM D calls ``get_finished`` every step)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = self.peer.read(0.005)
                break
            except DeadlineExceeded:
                assert time.monotonic() < deadline, f"P did not answer within {timeout_s} s"
                self.d.poll()
        assert "error" not in reply, reply

    def kill_midway(self, rids: list[str]) -> None:
        """SIGKILL P once D received a few of the batch (layers of the next in flight), start a new P."""
        deadline = time.monotonic() + 60.0
        while len([r for r in rids if r not in self.d.expect]) < 3:
            assert time.monotonic() < deadline, "P pushed nothing of the batch before its kill"
            self.d.poll()
            time.sleep(0.002)
        self.peer.kill()
        self.peer.close()
        self.d.counts["kills"] += 1
        self.peer = _start_p(self.extra)  # same configuration: same engine id, same D
        self.p_base = {}

    def wave(self, wave: int, rids: list[str], *, kill: bool, slow: bool) -> None:
        """One wave in batches; waits for the requests that must arrive, then frees what D received."""
        self.d.wait_pending(MAX_PENDING)
        batches = [rids[i : i + BATCH] for i in range(0, len(rids), BATCH)]
        kill_batch = self.rng.randrange(len(batches)) if kill else -1
        kinds = dict(zip(self.rng.sample(batches[0], 4), ("never", "p_abort", "d_before", "d_during"), strict=True))
        if slow:
            batches[-1] = [*batches[-1], f"slow{wave}"]
            kinds[f"slow{wave}"] = "slow"
        must: set[str] = set()
        for b, batch in enumerate(batches):
            must |= self.batch(batch, kinds, kill=b == kill_batch)
            if b == kill_batch:
                self.kills.append((wave, b))
        self.d.wait(must)
        self.d.free_received()
        if not self.p_base and kill_batch < 0:  # this P served a whole wave: its pools are at their steady size
            self.p_base = _held(self.peer)


@pytest.mark.timeout(max(240, REQUESTS // 4))
def test_layerwise_faults_with_p_killed_leave_nothing_behind() -> None:
    rng = random.Random(SEED)
    waves = -(-REQUESTS // WAVE)
    kill_waves = set(rng.sample(range(1, waves - 1), min(KILLS, waves - 2)))  # a whole wave after each
    slow_waves = {w for w in (1, 2, waves // 2, waves - 1) if w not in kill_waves and 0 < w < waves}
    port = free_port_range(1)
    extra: dict[str, Any] = {
        "engine_id": "chaosP",
        "kv_port": port,
        "prefill": {"tp_size": 1},
        "decode": {"tp_size": 1},
        "rpc_timeout_s": 1.0,
        "rpc_retries": 2,
        "fence_timeout_s": FENCE_S,  # P renews its claims at half of it (the same value on both sides)
    }
    d_cfg = LayerwiseConfig.from_kv_transfer_config(
        engine_id="chaosD",
        kv_role="kv_consumer",
        kv_port=port,
        extra={**extra, "first_layer_timeout_s": FIRST_S, "layer_timeout_s": LAYER_S},
        model="synthetic",
        dtype="int16",
    )
    ms = CollectingMetaserver()
    engine = MooncakeEngine("127.0.0.1")
    num_blocks = 2 * (2 * WAVE + MAX_PENDING + BATCH) + 16
    d = _D(LwInstance(d_cfg, Model(**SHAPE, num_blocks=num_blocks), engine=engine, metaserver=ms))
    regions = engine.registered
    chaos: _Chaos | None = None
    try:
        chaos = _Chaos(d, ms, extra, rng)
        fd_names: set[str] = set()
        fds = tasks = threads = -1
        for wave in range(waves):
            rids = [f"r{i}" for i in range(wave * WAVE, min((wave + 1) * WAVE, REQUESTS))]
            chaos.wave(wave, rids, kill=wave in kill_waves, slow=wave in slow_waves)
            if wave == 0:  # pools (threads, pooled sockets) at their steady size; no P killed yet
                fd_names, fds, tasks, threads = _fd_names(), len(_fd_names()), _tasks(), threading.active_count()
        d.wait_pending(1)
        d.free_received()
        d.poll()

        counts = d.counts
        print(f"layer-wise chaos: {REQUESTS} requests, {dict(counts)}, kills at (wave, batch) {chaos.kills}")
        # Controls: every fault happened, and most requests still arrived.
        assert counts["kills"] == len(kill_waves) > 0 and counts["slow"] > 0, counts
        assert counts["received"] > REQUESTS // 2 and counts["failed"] >= counts["never"] + counts["p_abort"], counts
        receiver = d.worker.receiver
        assert receiver is not None and len(receiver) == 0 and receiver.pending == 0
        assert d.inst.scheduler.tracked == 0 and not d.inst.blocks and not d.inst.requests
        assert not d.worker.take_failed() and not d.worker.get_block_ids_with_load_errors()
        assert counts["failed"] > FAILURE_REASONS_KEPT or REQUESTS < 480, counts  # the bound is exercised
        assert len(d.worker.failure_reasons) <= FAILURE_REASONS_KEPT, (
            f"D keeps {len(d.worker.failure_reasons)} failure reasons of {counts['failed']} failed requests"
        )
        assert engine.registered == regions
        # Known, not ours to close: Mooncake's TCP transport may keep a connection from a dead P's
        # session half-closed (CLOSE_WAIT). Bounded: only dead sessions, a few each.
        new_fds = _fd_names() - fd_names
        tcp = _tcp_sockets()
        stale = [f for f in new_fds if tcp.get(_inode(f), ("", ""))[1] == "08"]
        per_peer = Counter(tcp[_inode(f)][0].split("->")[1] for f in stale)
        print(f"  Mooncake sockets left in CLOSE_WAIT, per dead P address: {dict(per_peer)}")
        assert len(per_peer) <= len(chaos.kills) and max(per_peer.values(), default=0) <= 4, _describe(new_fds)
        assert len(_fd_names()) - len(stale) <= fds + 2, _describe(new_fds)
        assert _tasks() <= tasks and threading.active_count() <= threads

        held, base = _held(chaos.peer), chaos.p_base
        kept = (held["tracked"], held["blocks_held"], held["gates_closed"], held["failed_kept"], held["claims_kept"])
        assert kept == (0, 0, 0, 0, 0), held
        assert held["threads"] <= base["threads"] and held["fds"] <= base["fds"] + 2, (held, base)
        assert held["regions"] == base["regions"]
    finally:
        if chaos is not None:
            chaos.peer.close()
        d.inst.shutdown()
    assert engine.registered == {}, "D's registrations were not released"


def test_p_stalled_past_the_fence_writes_nothing_more(make_lw_pair: Callable[..., Any]) -> None:
    """P's forward stalls between two layers for longer than D's layer deadline and fence: D reports the
    request failed and vLLM recomputes into its blocks, so P must not write its next layer there. P
    renews its claim before a write once the claim is older than half of ``fence_timeout_s``; D
    answers ``unknown`` and P writes nothing more. Failed before: P's layer 1 landed in D's
    recomputed bytes (``s: layer 1 part 0 rank tp0 differs``)."""
    fence = {"layer_timeout_s": 0.5, "fence_timeout_s": 0.2}
    pair = make_lw_pair(d_extra=fence, p_extra=fence, layers=3, heads=1, head_dim=8)
    d = pair.d
    d.announce("s", PROMPT)
    pair.send_prefill(pair.metaserver.take("s"), PROMPT, seed=7, pause_s=1.5)
    errors = d.wait_recv({"s"}, timeout_s=10.0)  # D steps meanwhile: gives up at 0.5 s, fence over at 0.7 s
    assert errors == set(d.blocks["s"][0])
    d.recompute("s", seed=99)  # vLLM recomputes into the same blocks
    pair.read_prefill()  # P's next layer came at 1.5 s
    assert d.verify("s", seed=99) > 0  # D's own bytes, every layer
    assert pair.p_idle() == [0]
    # Control: the same stall shorter than D's deadline is pushed whole (the renewed claim is accepted).
    d.finish("s")
    d.announce("t", PROMPT)
    pair.send_prefill(pair.metaserver.take("t"), PROMPT, seed=8, pause_s=0.3)
    assert d.wait_recv({"t"}, timeout_s=10.0) == set()
    pair.read_prefill()
    assert d.verify("t", seed=8) > 0
