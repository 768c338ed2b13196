"""`MooncakeEngine.read` between two real Mooncake engines over TCP on 127.0.0.1, in this process.

Once the engine knows how fast a peer reads, a read is submitted without waiting and its thread
sleeps through most of it before Mooncake's spinning status wait (`core.transfer_pace`). These
tests check that such a read still lands every destination with its own source bytes, that it
fails loudly when Mooncake fails it, and that its thread no longer spins a core for the whole read.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from ascend_dist.common.errors import TransferError
from ascend_dist.common.regions import RegisterRegions
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine
from ascend_dist.kv_mooncake.core.transfer_pace import TransferPace

PIECE = 128 << 10
PIECES = 256  # 32 MiB per read, scattered as a KV pull's blocks are
SENTINEL = 0xA5


@dataclass
class Pair:
    d: MooncakeEngine
    p: MooncakeEngine
    pace: TransferPace  # D's
    src: np.ndarray
    dst: np.ndarray
    order: np.ndarray  # destination piece i <- source piece order[i]

    def batch(self) -> Descriptors:
        return _scattered(self.dst, self.src, self.order)

    def wrong_pieces(self) -> list[int]:
        return _wrong_pieces(self.dst, self.src, self.order)


def _scattered(dst: np.ndarray, src: np.ndarray, order: np.ndarray) -> Descriptors:
    """Destination piece i <- source piece ``order[i]``, for every piece of ``dst``."""
    pieces = dst.nbytes // PIECE
    local = dst.ctypes.data + np.arange(pieces, dtype=np.int64) * PIECE
    remote = src.ctypes.data + order[:pieces].astype(np.int64) * PIECE
    return Descriptors(local, remote, np.full(pieces, PIECE, dtype=np.int64))


def _wrong_pieces(dst: np.ndarray, src: np.ndarray, order: np.ndarray) -> list[int]:
    """Destinations that do not hold their own source piece (unwritten ones hold the sentinel)."""
    got, want = dst.reshape(-1, PIECE), src.reshape(-1, PIECE)
    return [i for i in range(len(got)) if not np.array_equal(got[i], want[order[i]])]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, 2 * PIECES * PIECE, dtype=np.uint8)
    dst = np.full(PIECES * PIECE, SENTINEL, dtype=np.uint8)
    pace = TransferPace()
    d, p = MooncakeEngine("127.0.0.1", pace=pace), MooncakeEngine("127.0.0.1")
    d.register(RegisterRegions((dst.ctypes.data,), (dst.nbytes,)))
    p.register(RegisterRegions((src.ctypes.data,), (src.nbytes,)))
    order = rng.permutation(2 * PIECES)[:PIECES]
    yield Pair(d, p, pace, src, dst, order)
    d.unregister(RegisterRegions((dst.ctypes.data,), (dst.nbytes,)))
    p.unregister(RegisterRegions((src.ctypes.data,), (src.nbytes,)))


def _read(pair: Pair) -> tuple[float, float]:
    """One read into a destination reset to the sentinel; (wall s, this thread's CPU s)."""
    pair.dst[:] = SENTINEL
    wall, cpu = time.perf_counter(), time.thread_time()
    pair.d.read(pair.p.session, pair.batch())
    return time.perf_counter() - wall, time.thread_time() - cpu


@pytest.mark.timeout(120)
def test_a_paced_read_lands_every_destination_and_its_thread_sleeps_through_most_of_it(pair: Pair) -> None:
    """The first read from P teaches its rate (one spinning wait); each later read sleeps first and
    must still land all 256 pieces, each with its own source bytes. The reading thread's CPU time
    shows the sleep: a spinning wait keeps the thread on a core for the whole read (CPU about equal
    to wall time, which is what the reads printed here measured before pacing)."""
    _read(pair)
    assert pair.wrong_pieces() == []
    ratios = []
    for _ in range(5):
        wall, cpu = _read(pair)
        assert pair.wrong_pieces() == []
        ratios.append(cpu / wall)
    assert pair.pace.sleep_s(pair.p.session, PIECES * PIECE) > 0  # the later reads were paced
    assert min(ratios) < 0.5, [f"{r:.2f}" for r in ratios]


@pytest.mark.timeout(120)
def test_the_sleep_does_not_outgrow_the_reads_while_another_thread_holds_the_interpreter_lock(pair: Pair) -> None:
    """As in a worker, where the engine loop runs Python beside the readers: each wake-up (from the
    sleep, from Mooncake's wait) first waits for the interpreter lock, up to the switch interval.
    Were those waits learnt as transfer time, each sleep would be longer than the read before it
    (measured with that rule: sleeps grew to 35 ms before 5 ms reads within 40 reads). Reads of
    8 MiB by a D engine of its own; once settled, the sleep must stay near what a read takes.

    The first read is a spinning one whose wall time, stretched by the lock holder on a busy
    machine, may teach a long first sleep (22 ms once in CI); an overslept read teaches its sleep,
    so that shrinks by the share each read. What must not happen is growth, so the bound applies
    to the sleeps of the second half."""
    pieces = 64
    pace = TransferPace()
    d = MooncakeEngine("127.0.0.1", pace=pace)
    dst = np.full(pieces * PIECE, SENTINEL, dtype=np.uint8)
    d.register(RegisterRegions((dst.ctypes.data,), (dst.nbytes,)))
    batch = _scattered(dst, pair.src, pair.order)
    idle = []
    for _ in range(5):
        start = time.perf_counter()
        assert d.raw_read(pair.p.session, batch) == 0
        idle.append(time.perf_counter() - start)
    stop = threading.Event()

    def hold_the_lock() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    holder = threading.Thread(target=hold_the_lock, daemon=True)
    holder.start()
    sleeps = []
    try:
        for _ in range(60):
            d.read(pair.p.session, batch)
            sleeps.append(pace.sleep_s(pair.p.session, int(batch.lengths.sum())))
    finally:
        stop.set()
        holder.join(5.0)
        d.unregister(RegisterRegions((dst.ctypes.data,), (dst.nbytes,)))
    assert _wrong_pieces(dst, pair.src, pair.order) == []
    bound = pace.share * (3 * statistics.median(idle) + 2 * sys.getswitchinterval())
    settled = sleeps[len(sleeps) // 2 :]
    shown = (f"bound {bound * 1e3:.1f} ms", "second half:", [f"{s * 1e3:.1f}" for s in settled])
    assert statistics.median(settled) <= bound, shown
    assert max(settled) <= 2 * bound, shown


@pytest.mark.timeout(60)
def test_a_paced_read_from_a_peer_that_is_gone_raises(pair: Pair) -> None:
    """A read D expects to sleep through (its peer's rate is known) from a peer no longer there:
    Mooncake submits nothing, and the read raises instead of sleeping and returning as landed."""
    gone = f"127.0.0.1:{free_port_range(1)}"  # bound and released: nothing listens there
    pair.pace.observe(gone, PIECES * PIECE, 0.02)
    assert pair.pace.sleep_s(gone, PIECES * PIECE) > 0
    pair.dst[:] = SENTINEL
    local = pair.dst.ctypes.data + np.arange(PIECES, dtype=np.int64) * PIECE
    batch = Descriptors(local, local.copy(), np.full(PIECES, PIECE, dtype=np.int64))
    with pytest.raises(TransferError, match="Mooncake read returned"):
        pair.d.read(gone, batch)
    assert int(pair.dst[0]) == SENTINEL
