"""Layer-wise saves the transport executes faithfully, against a real ``mooncake_master`` on loopback.

Mooncake's TCP transport fails a put of more than about 2,048 pieces to a remote segment with -800
(the same limit as gets), and a key repeated in one put is answered 0 for every copy while only
the first copy is stored. So a layer's put is cut at the backend's piece cap and carries each key
once (the same key holds the same bytes by construction: one copy suffices, its outcome counts for
every request holding the chunk). Instance A saves with a client that contributes no memory, so
its puts go to another client's segment over TCP (a put into one's own segment is a local copy
with no such limit); instance B loads what A stored and compares every byte. The master here
(conftest's `long_lease_master`) grants 10 s leases: the shared fixture's 200 ms expire under a
loaded CI machine mid-get (LEASE_EXPIRED).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from ascend_dist.kv_store import NewRequest, PoolConfig, PoolSpec, StepInput, build_scheduler, build_worker
from ascend_dist.kv_store.backends.mooncake import MooncakeBackend
from ascend_dist.kv_store.config.config import MooncakeStoreConfig
from ascend_dist.kv_store.master_process import MasterProcess

pytestmark = pytest.mark.mooncake
SPEC = PoolSpec(model="tiny-lw-saves", block_sizes=(16,), num_kv_heads=2)
LAYERWISE = PoolConfig.from_extra({"use_layerwise": True})


def backend_for(master: MasterProcess, *, contribute: bool) -> MooncakeBackend:
    cfg = {
        "metadata_server": "P2PHANDSHAKE", "master_server_address": master.address, "protocol": "tcp",
        "global_segment_size": "64MB", "local_buffer_size": "16MB",
    }  # fmt: skip
    return MooncakeBackend(MooncakeStoreConfig.load(cfg, env={}), contribute_memory=contribute)


@pytest.fixture(scope="session")
def master(long_lease_master: MasterProcess) -> MasterProcess:
    """conftest's master with 10 s leases (big gets outlast the shared master's 200 ms under load)."""
    return long_lease_master


class Recording:
    """A `PoolBackend` around the real Mooncake backend that records every put call."""

    def __init__(self, inner: MooncakeBackend) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_pieces_per_call = inner.max_pieces_per_call
        self.puts: list[tuple[tuple[str, ...], int]] = []  # (keys, pieces) per call
        self._lock = threading.Lock()

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        self.inner.register_buffer(ptrs, lengths)

    def exists(self, keys: Sequence[str]) -> list[int]:
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        with self._lock:
            self.puts.append((tuple(keys), sum(len(a) for a in addrs)))
        return self.inner.put(keys, addrs, sizes)

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        return self.inner.get(keys, addrs, sizes)

    def close(self) -> None:
        self.inner.close()


class Instance:
    """A layer-wise scheduler and worker over CPU caches; its client contributes no memory."""

    def __init__(self, master, kvtools, seed: int, *, layers: int = 2, blocks: int = 16) -> None:
        self.backend = Recording(backend_for(master, contribute=False))
        self.worker = build_worker(SPEC, LAYERWISE, self.backend)
        self.caches = kvtools.make(num_layers=layers, num_blocks=blocks, seed=seed)
        self.worker.register_kv_caches(self.caches, blocks)
        self.scheduler = build_scheduler(SPEC, LAYERWISE, self.worker.safe_lookup)

    def layer_block(self, layer: str, block: int) -> bytes:
        k, v = self.caches[layer]
        return k[block].numpy().tobytes() + v[block].numpy().tobytes()

    def step(self, reqs: dict[str, tuple[list[int], list[int]]]) -> dict[str, int]:
        """One step of new requests, in vLLM's order; returns the tokens each loaded."""
        need: dict[str, int] = {}
        for req_id, (prompt, blocks) in reqs.items():
            need[req_id], _ = self.scheduler.get_num_new_matched_tokens(req_id, prompt, len(prompt), 0)
            self.scheduler.update_state_after_alloc(req_id, [blocks], need[req_id])
        meta = self.scheduler.build_meta(
            StepInput(new=[NewRequest(r, p, [b], need[r], len(p) - need[r]) for r, (p, b) in reqs.items()])
        )
        self.worker.bind_step(meta)
        self.worker.start_load_kv(meta)
        for name in self.caches:
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name)
        self.worker.wait_for_save(meta)
        self.worker.drain(60)
        return need

    def close(self) -> None:
        self.worker.close()
        self.backend.close()


@pytest.fixture(scope="module")
def server(master: MasterProcess) -> Iterator[MooncakeBackend]:
    """The client whose segment holds what the instances put (over TCP)."""
    backend = backend_for(master, contribute=True)
    try:
        yield backend
    finally:
        backend.close()


def test_mooncake_stores_the_first_copy_of_a_key_repeated_in_one_put(master, server) -> None:
    """``put([k0, k1, k0])`` from three different sources: 0 three times, ``k0`` holds the FIRST copy.

    A contract test of Mooncake 0.3.13 (why a layer's put carries each key once: the answer of a
    second copy says nothing about its bytes).
    """
    writer, reader = backend_for(master, contribute=False), backend_for(master, contribute=False)
    try:
        piece = 4096
        src = np.random.default_rng(11).integers(0, 256, 3 * piece, dtype=np.uint8)
        dst = np.zeros(2 * piece, dtype=np.uint8)
        writer.register_buffer([src.ctypes.data], [src.nbytes])
        reader.register_buffer([dst.ctypes.data], [dst.nbytes])
        keys = ["lw-dup-0", "lw-dup-1", "lw-dup-0"]
        assert writer.put(keys, [[src.ctypes.data + i * piece] for i in range(3)], [[piece]] * 3) == [0, 0, 0]
        assert reader.get(keys[:2], [[dst.ctypes.data], [dst.ctypes.data + piece]], [[piece]] * 2) == [0, 0]
        assert bytes(dst[:piece]) == bytes(src[:piece])  # the first copy ...
        assert bytes(dst[:piece]) != bytes(src[2 * piece :])  # ... not the last
    finally:
        writer.close()
        reader.close()


def test_a_layerwise_step_above_the_piece_cap_is_stored_byte_exact(master, kvtools, server) -> None:
    """1,100 chunks x K/V = 2,200 pieces per layer: over what one TCP put carries (-800 uncut)."""
    chunks, layers = 1100, 2
    a = Instance(master, kvtools, 51, layers=layers, blocks=chunks + 2)
    b = Instance(master, kvtools, 52, layers=layers, blocks=chunks + 2)
    try:
        prompt = list(range(200_000, 200_000 + chunks * 16 + 5))
        blocks = list(range(1, chunks + 2))
        assert a.step({"a": (prompt, blocks)}) == {"a": 0}
        assert a.worker.stats.saved_keys == chunks * layers
        cap = a.backend.max_pieces_per_call
        assert cap is not None and all(pieces <= cap for _, pieces in a.backend.puts)
        assert b.step({"b": (prompt, blocks)}) == {"b": chunks * 16}
        assert b.worker.get_block_ids_with_load_errors() == set()
        for name in a.caches:
            assert all(b.layer_block(name, x) == a.layer_block(name, x) for x in range(1, chunks + 1))
    finally:
        a.close()
        b.close()


def test_two_requests_sharing_chunks_in_one_step_put_each_key_once(master, kvtools, server) -> None:
    """Prefix caching off: r0 and r1 hold the same 4 chunks in different blocks, saved in one step."""
    a = Instance(master, kvtools, 53, blocks=16)
    b = Instance(master, kvtools, 54, blocks=16)
    try:
        prompt = list(range(300_000, 300_000 + 4 * 16 + 3))
        for name in a.caches:  # one prompt computes the same KV in both requests' blocks
            for kv in a.caches[name]:
                kv[6:11] = kv[1:6]
        a.step({"r0": (prompt, [1, 2, 3, 4, 5]), "r1": (prompt, [6, 7, 8, 9, 10])})
        assert a.backend.puts, "nothing was put"
        for keys, _ in a.backend.puts:
            assert len(keys) == len(set(keys)), "a key twice in one put"
        assert a.worker.stats.saved_keys == 4 * 2  # 4 chunks x 2 layers, each stored once
        assert b.step({"b": (prompt, [11, 12, 13, 14, 15])}) == {"b": 64}
        assert b.worker.get_block_ids_with_load_errors() == set()
        for name in a.caches:
            assert all(b.layer_block(name, 10 + x) == a.layer_block(name, x) for x in range(1, 5))
    finally:
        a.close()
        b.close()
