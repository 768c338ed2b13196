"""Loads that cannot be silently wrong (issue 21), against a real ``mooncake_master`` on loopback.

First the transport's contract, which the pool has to work around: Mooncake 0.3.13 writes a key
repeated in one batch ``get`` only into its last destination and answers 0 for every copy, and its
TCP transport fails a batch of more than about 2,048 pieces per peer with -800. Then the pool:
instance A pools a prompt; instance B loads it for two or three requests of ONE step that hold the
shared chunks in different blocks (what vLLM does with prefix caching off), in every load mode.
`LoadVerifier` fills every destination with a sentinel before the load and checks every byte after it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest

from ascend_dist.kv_store import NewRequest, PoolConfig, PoolSpec, StepInput, build_scheduler, build_worker
from ascend_dist.kv_store.backends.mooncake import MooncakeBackend
from ascend_dist.kv_store.config.config import MooncakeStoreConfig
from ascend_dist.kv_store.step_metadata import PoolStepMeta
from ascend_dist.testing.pool_checks import Destination, LoadVerificationError, LoadVerifier

pytestmark = pytest.mark.mooncake
SPEC = PoolSpec(model="tiny-shared", block_sizes=(16,), num_kv_heads=2)
BLOCK = 16
MODES = {"sync": {}, "async": {"load_async": True}, "layerwise": {"use_layerwise": True}}
SENTINEL = -3.0


def backend_for(master, segment: str = "64MB", **kw) -> MooncakeBackend:
    return MooncakeBackend(MooncakeStoreConfig.load(master.config(segment=segment), env={}), **kw)


# ---- the transport's contract ----


def test_mooncake_writes_a_repeated_key_only_into_its_last_destination(mooncake_master) -> None:
    """``get([k0, k1, k0, k2, k2])`` answers 0 five times, yet destinations 0 and 3 are never written.

    A contract test of Mooncake 0.3.13, the reason loads never repeat a key in one call: if it fails,
    Mooncake changed (and the rounds of `load_batches` became unnecessary, not wrong).
    """
    writer, reader = backend_for(mooncake_master), backend_for(mooncake_master, contribute_memory=False)
    try:
        piece = 4096
        src = np.random.default_rng(7).integers(0, 256, 3 * piece, dtype=np.uint8)
        dst = np.full(5 * piece, 0xAB, dtype=np.uint8)
        writer.register_buffer([src.ctypes.data], [src.nbytes])
        reader.register_buffer([dst.ctypes.data], [dst.nbytes])
        keys = [f"dup-{i}" for i in range(3)]
        assert writer.put(keys, [[src.ctypes.data + i * piece] for i in range(3)], [[piece]] * 3) == [0, 0, 0]
        order = [0, 1, 0, 2, 2]
        codes = reader.get([keys[i] for i in order], [[dst.ctypes.data + j * piece] for j in range(5)], [[piece]] * 5)
        assert codes == [0] * 5  # every copy reported loaded
        written = [bytes(dst[j * piece : (j + 1) * piece]) == bytes(src[k * piece : (k + 1) * piece]) for j, k in
                   enumerate(order)]  # fmt: skip
        untouched = [bytes(dst[j * piece : (j + 1) * piece]) == b"\xab" * piece for j in range(5)]
        assert written == [False, True, True, False, True]
        assert untouched == [True, False, False, True, False]  # the first copies: never written, no error
    finally:
        writer.close()
        reader.close()


def _many_pieces(writer: MooncakeBackend, reader: MooncakeBackend, prefix: str, total: int, piece: int):
    """32 keys of ``total / 32`` pieces each, put by ``writer``; the reader's get arguments and the source."""
    per = total // 32
    src = np.random.default_rng(total).integers(0, 256, total * piece, dtype=np.uint8)
    dst = np.full(total * piece, 0xAB, dtype=np.uint8)
    writer.register_buffer([src.ctypes.data], [src.nbytes])
    reader.register_buffer([dst.ctypes.data], [dst.nbytes])
    keys = [f"{prefix}-{total}-{j}" for j in range(32)]
    offsets = [[(j * per + p) * piece for p in range(per)] for j in range(32)]
    sizes = [[piece] * per for _ in range(32)]
    put = writer.put(keys, [[src.ctypes.data + o for o in row] for row in offsets], sizes)
    assert put == [0] * 32
    return keys, [[dst.ctypes.data + o for o in row] for row in offsets], sizes, src, dst


@pytest.mark.timeout(240)  # Mooncake's own failure path for the 4,608-piece get takes ~30-60 s
def test_mooncake_tcp_fails_a_get_of_more_than_2048_pieces_per_peer(long_lease_master) -> None:
    """4,608 pieces in one get from a peer fail with -800 (never silently); 2,048 load byte-exact."""
    writer, reader = backend_for(long_lease_master), backend_for(long_lease_master, contribute_memory=False)
    native = reader.native_client()  # the raw batch call, without the backend's cap
    try:
        for total, fails in ((2048, False), (4608, True)):
            keys, addrs, sizes, src, dst = _many_pieces(writer, reader, "cap", total, 4096)
            codes = [0 if c >= 0 else c for c in native.batch_get_into_multi_buffers(keys, addrs, sizes)]
            assert (-800 in codes) is fails, codes
            per = total // 32 * 4096
            for j, code in enumerate(codes):  # a key answered 0 holds its bytes even when others failed
                if code == 0:
                    assert bytes(dst[j * per : (j + 1) * per]) == bytes(src[j * per : (j + 1) * per])
    finally:
        writer.close()
        reader.close()


# ---- the pool: requests of one step sharing pooled chunks in different blocks ----


class Instance:
    """A scheduler and a worker over CPU caches on the real Mooncake store."""

    def __init__(
        self, master, kvtools, seed: int, extra: dict[str, object], *, layers: int = 2, blocks: int = 16
    ) -> None:
        self.cfg = PoolConfig.from_extra(extra)
        self.backend = backend_for(master)
        self.worker = build_worker(SPEC, self.cfg, self.backend)
        self.caches = kvtools.make(num_layers=layers, num_blocks=blocks, seed=seed)
        self.layers = list(self.caches)
        self.worker.register_kv_caches(self.caches, blocks)
        self.scheduler = build_scheduler(SPEC, self.cfg, self.worker.safe_lookup)
        self._bytes = kvtools.block_bytes

    def block(self, block_id: int) -> bytes:
        return self._bytes(self.caches, block_id)

    def fill(self, block_ids: Sequence[int]) -> None:
        for k, v in self.caches.values():
            k[list(block_ids)] = SENTINEL
            v[list(block_ids)] = SENTINEL

    def run_step(self, meta: PoolStepMeta) -> None:
        """The worker's calls of one step, in vLLM's order (layer-wise: wait/save per layer)."""
        self.worker.start_load_kv(meta)
        if self.cfg.use_layerwise:
            for name in self.layers:
                self.worker.wait_for_layer_load(name)
                self.worker.save_kv_layer(name)
        self.worker.wait_for_save(meta)

    def close(self) -> None:
        self.worker.close()


def pool_prompt(a: Instance, prompt: list[int], blocks: list[int]) -> None:
    """A computes and saves ``prompt`` (every full chunk reaches the pool)."""
    need, _ = a.scheduler.get_num_new_matched_tokens("a", prompt, len(prompt), 0)
    assert need == 0
    a.scheduler.update_state_after_alloc("a", [blocks], 0)
    a.run_step(a.scheduler.build_meta(StepInput(new=[NewRequest("a", prompt, [blocks], 0, len(prompt))])))
    a.worker.drain(30)


def load_step(b: Instance, reqs: dict[str, tuple[list[int], list[int]]], async_mode: bool) -> set[int]:
    """B schedules every request of ``reqs`` (prompt, blocks) in ONE step; the block ids reported failed."""
    new = []
    for req_id, (prompt, blocks) in reqs.items():
        need, is_async = b.scheduler.get_num_new_matched_tokens(req_id, prompt, len(prompt), 0)
        assert need > 0 and is_async is async_mode
        b.scheduler.update_state_after_alloc(req_id, [blocks], need)
        new.append(NewRequest(req_id, prompt, [blocks], need, len(prompt) - need))
    meta = b.scheduler.build_meta(StepInput() if async_mode else StepInput(new=new))
    assert sorted(r.req_id for r in meta.requests if r.load_spec is not None) == sorted(reqs)
    b.run_step(meta)
    if async_mode:
        done: set[str] = set()
        deadline = time.monotonic() + 30
        while done != set(reqs) and time.monotonic() < deadline:
            done |= b.worker.get_finished(set())[1]
            time.sleep(0.01)
        assert done == set(reqs), f"async loads not finished: {set(reqs) - done}"
    return b.worker.get_block_ids_with_load_errors()


def shared_requests(base: int, chunks: int, count: int) -> dict[str, tuple[list[int], list[int]]]:
    """``count`` requests over the first ``chunks`` pooled chunks (the third shares one chunk fewer)."""
    reqs: dict[str, tuple[list[int], list[int]]] = {}
    next_block = 1
    for i in range(count):
        shared = chunks if i < 2 else chunks - 1
        prompt = list(range(base, base + shared * BLOCK)) + [base + 50_000 + 100 * i + t for t in range(5)]
        blocks = list(range(next_block, next_block + shared + 1))
        next_block += shared + 1
        reqs[f"r{i}"] = (prompt, blocks)
    return reqs


def expected(reqs: dict[str, tuple[list[int], list[int]]], pooled: list[bytes]) -> list[Destination]:
    """Each request's shared chunks must hold A's bytes of those chunks."""
    out = []
    for req_id, (prompt, blocks) in reqs.items():
        for i in range(len(prompt) // BLOCK):
            out.append(Destination(req_id, blocks[i], pooled[i]))
    return out


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("mode", list(MODES))
def test_requests_sharing_pooled_chunks_in_one_step_load_every_block(mooncake_master, kvtools, mode, count) -> None:
    """Two or three requests hold A's chunks in different blocks: every block of every one holds A's bytes."""
    extra = MODES[mode]
    a = Instance(mooncake_master, kvtools, 31, extra)
    b = Instance(mooncake_master, kvtools, 32, extra)
    try:
        chunks = 3
        base = 20_000 + 1000 * list(MODES).index(mode) + 100 * count
        prompt = list(range(base, base + chunks * BLOCK + 5))
        pool_prompt(a, prompt, [1, 2, 3, 4])
        pooled = [a.block(x) for x in (1, 2, 3)]
        assert len(set(pooled)) == chunks  # control: a chunk in the wrong block cannot pass

        reqs = shared_requests(base, chunks, count)
        verifier = LoadVerifier(b.block, b.fill)
        verifier.arm(expected(reqs, pooled))
        failed = load_step(b, reqs, async_mode=mode == "async")
        assert failed == set(), "the load reported failed blocks"
        verifier.check(failed)
    finally:
        a.close()
        b.close()


def test_verifier_fails_when_the_load_is_skipped(mooncake_master, kvtools) -> None:
    """Control of the hook: B's step runs without its load (the metadata holds no load spec)."""
    a = Instance(mooncake_master, kvtools, 33, {})
    b = Instance(mooncake_master, kvtools, 34, {})
    try:
        base = 24_000
        prompt = list(range(base, base + 3 * BLOCK + 5))
        pool_prompt(a, prompt, [1, 2, 3, 4])
        pooled = [a.block(x) for x in (1, 2, 3)]
        reqs = shared_requests(base, 3, 2)
        verifier = LoadVerifier(b.block, b.fill)
        verifier.arm(expected(reqs, pooled))
        b.run_step(PoolStepMeta(requests=()))  # a step that loads nothing
        with pytest.raises(LoadVerificationError, match="request 'r0' block 1: never written"):
            verifier.check()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_step_of_5120_pieces_loads_byte_exact(long_lease_master, kvtools, mode) -> None:
    """64 chunks x 40 layers x K/V in one step: more than twice what one Mooncake TCP get carries."""
    layers, chunks = 40, 64
    a = Instance(long_lease_master, kvtools, 37, MODES[mode], layers=layers, blocks=chunks + 2)
    b = Instance(long_lease_master, kvtools, 38, MODES[mode], layers=layers, blocks=chunks + 2)
    try:
        base = 30_000 + 10_000 * (mode == "async")
        prompt = list(range(base, base + chunks * BLOCK + 5))
        pool_prompt(a, prompt, list(range(1, chunks + 2)))
        assert a.worker.stats.saved_keys == chunks
        pooled = [a.block(x) for x in range(1, chunks + 1)]
        reqs = {"big": (prompt, list(range(1, chunks + 2)))}
        verifier = LoadVerifier(b.block, b.fill)
        verifier.arm(expected(reqs, pooled))
        failed = load_step(b, reqs, async_mode=mode == "async")
        assert failed == set(), f"{len(failed)} blocks failed to load"
        verifier.check(failed)
        assert b.worker.stats.loaded_keys == chunks and chunks * 2 * layers > 5000
    finally:
        a.close()
        b.close()


# ---- the hook's findings, on plain byte blocks ----


class Blocks:
    """Plain byte blocks for the hook's own tests."""

    def __init__(self, ids: Sequence[int], size: int = 8) -> None:
        self.data = {i: bytearray(size) for i in ids}

    def read(self, block: int) -> bytes:
        return bytes(self.data[block])

    def fill(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.data[b][:] = b"\xee" * len(self.data[b])


def test_verifier_names_unwritten_and_foreign_blocks() -> None:
    blocks = Blocks([1, 2, 3])
    verifier = LoadVerifier(blocks.read, blocks.fill)
    verifier.arm([Destination("x", 1, b"A" * 8), Destination("y", 2, b"B" * 8), Destination("y", 3, b"C" * 8)])
    blocks.data[1][:] = b"B" * 8  # x's block holds y's bytes
    blocks.data[2][:] = b"B" * 8  # right
    # block 3 unwritten
    with pytest.raises(LoadVerificationError) as err:
        verifier.check()
    lines = str(err.value).splitlines()[1:]
    assert lines == [
        "request 'x' block 1: holds the bytes meant for request 'y' block 2",
        "request 'y' block 3: never written (still holds the sentinel)",
    ]
    verifier.check(failed_blocks={1, 3})  # blocks reported failed are not claimed loaded
    blocks.data[1][:] = b"A" * 8
    blocks.data[3][:] = b"C" * 7 + b"D"
    with pytest.raises(LoadVerificationError, match=r"block 3: holds other bytes \(first difference at byte 7 of 8\)"):
        verifier.check()
    blocks.data[3][:] = b"C" * 8
    verifier.check()


def test_verifier_refuses_a_sentinel_equal_to_the_expected_bytes() -> None:
    blocks = Blocks([1])
    verifier = LoadVerifier(blocks.read, blocks.fill)
    with pytest.raises(LoadVerificationError, match="sentinel equals"):
        verifier.arm([Destination("x", 1, b"\xee" * 8)])
    with pytest.raises(LoadVerificationError, match="before arm"):
        verifier.check()


def test_verifier_catches_the_repeated_key_get(mooncake_master) -> None:
    """Control of the hook on the hazard itself: one raw get with a repeated key, as today's sync load sends it."""
    writer, reader = backend_for(mooncake_master), backend_for(mooncake_master, contribute_memory=False)
    try:
        piece = 4096
        src = np.random.default_rng(9).integers(0, 256, 2 * piece, dtype=np.uint8)
        dst = np.zeros(4 * piece, dtype=np.uint8)
        writer.register_buffer([src.ctypes.data], [src.nbytes])
        reader.register_buffer([dst.ctypes.data], [dst.nbytes])
        keys = ["hook-0", "hook-1"]
        assert writer.put(keys, [[src.ctypes.data], [src.ctypes.data + piece]], [[piece]] * 2) == [0, 0]

        def read(block: int) -> bytes:
            return bytes(dst[block * piece : (block + 1) * piece])

        def fill(blocks: Sequence[int]) -> None:
            for blk in blocks:
                dst[blk * piece : (blk + 1) * piece] = 0x5A

        verifier = LoadVerifier(read, fill)
        chunk = [bytes(src[:piece]), bytes(src[piece:])]
        # request r0 holds the two chunks in blocks 0-1, request r1 in blocks 2-3
        verifier.arm([Destination("r0", 0, chunk[0]), Destination("r0", 1, chunk[1]),
                      Destination("r1", 2, chunk[0]), Destination("r1", 3, chunk[1])])  # fmt: skip
        codes = reader.get([*keys, *keys], [[dst.ctypes.data + b * piece] for b in range(4)], [[piece]] * 4)
        assert codes == [0] * 4
        with pytest.raises(LoadVerificationError, match="request 'r0' block 0: never written"):
            verifier.check()
    finally:
        writer.close()
        reader.close()
