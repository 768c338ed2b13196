"""The Mooncake Store backend and the whole pool against a real ``mooncake_master`` on loopback."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ascend_dist.common.errors import ConfigError, StoreError
from ascend_dist.kv_store import (
    LookupClient,
    LookupServer,
    NewRequest,
    PoolConfig,
    PoolSpec,
    StepInput,
    build_scheduler,
    build_worker,
)
from ascend_dist.kv_store.backends.mooncake import MooncakeBackend
from ascend_dist.kv_store.config.config import MooncakeStoreConfig

pytestmark = pytest.mark.mooncake
SPEC = PoolSpec(model="tiny", block_sizes=(16,), num_kv_heads=2)
CHILD = Path(__file__).with_name("pool_child.py")


def backend_for(master, *, segment: str = "64MB", preferred_segment: bool = False, **kw) -> MooncakeBackend:
    cfg = {**master.config(segment), "preferred_segment": preferred_segment}
    return MooncakeBackend(MooncakeStoreConfig.load(cfg, env={}), **kw)


def test_backend_multi_buffer_round_trip(mooncake_master) -> None:
    be = backend_for(mooncake_master)
    try:
        src = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8)
        dst = np.zeros(8192, dtype=np.uint8)
        be.register_buffer([src.ctypes.data, dst.ctypes.data], [src.nbytes, dst.nbytes])
        base, out = src.ctypes.data, dst.ctypes.data
        keys = ["rt-a", "rt-b"]
        assert be.put(keys, [[base, base + 4096], [base + 1024]], [[1024, 1024], [512]]) == [0, 0]
        assert be.put(keys[:1], [[base]], [[2048]]) == [0]  # re-put of an existing key counts as stored
        assert be.exists([*keys, "rt-missing"]) == [1, 1, 0]
        # destination split differs from the source split; totals match
        codes = be.get(
            [*keys, "rt-missing"], [[out], [out + 2048, out + 2304], [out + 4096]], [[2048], [256, 256], [64]]
        )
        assert codes == [0, 0, -704]
        assert bytes(dst[:1024]) == bytes(src[:1024]) and bytes(dst[1024:2048]) == bytes(src[4096:5120])
        assert bytes(dst[2048:2560]) == bytes(src[1024:1536])
        assert be.get(keys[:1], [[out]], [[1024]]) == [-600]  # destination too small
    finally:
        be.close()


def test_preferred_segment_puts_into_the_own_segment(mooncake_master) -> None:
    """``preferred_segment``: puts land in the putting client's own segment (a memory copy, not TCP).

    Proof: the objects vanish with that segment when the client closes. Control: a client without
    the setting (and the default ``prefer_alloc_in_same_node``) spreads its puts, so some outlive
    it; an ignored setting, or one the same-node flag overrides (Mooncake 0.3.13), fails.
    """
    mine = backend_for(mooncake_master, segment="32MB", preferred_segment=True)
    plain = backend_for(mooncake_master, segment="32MB")
    other = backend_for(mooncake_master, segment="32MB")  # a third segment the master may choose
    try:
        assert mine.preferred_segment == mine.native_client().get_hostname() and plain.preferred_segment is None
        src = np.random.default_rng(1).integers(0, 256, 64 << 10, dtype=np.uint8)
        pieces = [[src.ctypes.data + 1024 * i, src.ctypes.data + 32768 + 1024 * i] for i in range(32)]
        keys = {n: [f"seg-{n}-{i}" for i in range(32)] for n in ("mine", "plain")}
        for name, be in (("mine", mine), ("plain", plain)):
            be.register_buffer([src.ctypes.data], [src.nbytes])
            assert be.put(keys[name], pieces, [[1024, 1024]] * 32) == [0] * 32
        dst = np.zeros(2048, dtype=np.uint8)
        other.register_buffer([dst.ctypes.data], [dst.nbytes])
        assert other.get(keys["mine"][5:6], [[dst.ctypes.data]], [[2048]]) == [0]  # readable by others
        assert bytes(dst) == bytes(src[5120:6144]) + bytes(src[32768 + 5120 : 32768 + 6144])
        mine.close()
        assert other.exists(keys["mine"]) == [0] * 32  # every object was in mine's segment
        plain.close()
        assert 1 in other.exists(keys["plain"])  # the control: the master's own choice spread them
    finally:
        for be in (mine, plain, other):
            be.close()


class SetupRecorder:
    """A fake of our own `MooncakeStoreClient` Protocol that records ``setup`` (and can be an old Mooncake)."""

    def __init__(self, *, old: bool = False) -> None:
        self.old = old
        self.setup_args: tuple[object, ...] = ()

    def setup(self, *args: object) -> int:
        if self.old and len(args) > 7:
            raise TypeError("setup(): incompatible function arguments")
        self.setup_args = args
        return 0

    def close(self) -> int:
        return 0


def test_ssd_offload_gets_a_directory_per_rank(mooncake_master, tmp_path) -> None:
    """Mooncake's file storage refuses a directory that does not exist: the backend creates ``rank_<r>``.

    (A fake client: on this machine Mooncake 0.3.13's file storage answers UNABLE_OFFLOAD on some
    runs, so a real SSD round trip is not a reliable test here.)
    """
    cfg = MooncakeStoreConfig.load({**mooncake_master.config(), "enable_ssd_offload": True,
                                    "ssd_offload_path": str(tmp_path)}, env={})  # fmt: skip
    fake = SetupRecorder()
    be = MooncakeBackend(cfg, global_rank=3, store_factory=lambda: fake)
    try:
        assert be.connected and (tmp_path / "rank_3").is_dir()
        assert fake.setup_args[-3:] == (None, True, str(tmp_path / "rank_3"))
        assert MooncakeBackend(cfg, contribute_memory=False, store_factory=lambda: fake).connected
        assert len(fake.setup_args) == 7  # a client that contributes no memory offloads nothing
    finally:
        be.close()
    with pytest.raises(ConfigError, match="enable_ssd_offload"):
        MooncakeBackend(cfg, store_factory=lambda: SetupRecorder(old=True))


def test_ssd_and_fabric_memory_settings_are_checked(mooncake_master) -> None:
    base = mooncake_master.config()
    with pytest.raises(ConfigError, match="ssd_offload_path"):
        MooncakeStoreConfig.load({**base, "enable_ssd_offload": True, "ssd_offload_path": "relative/dir"}, env={})
    fabric = MooncakeStoreConfig.load({**base, "global_segment_size": "2GB"}, env={"ASCEND_ENABLE_USE_FABRIC_MEM": "1"})
    assert fabric.fabric_mem and fabric.local_buffer_size == 0
    with pytest.raises(ConfigError, match="global_segment_size"):
        MooncakeStoreConfig.load({**base, "global_segment_size": "1.5GB"}, env={"ASCEND_ENABLE_USE_FABRIC_MEM": "1"})


def test_unreachable_store_at_start_gives_misses_and_one_warning(caplog, kvtools) -> None:
    cfg = MooncakeStoreConfig.load({"master_server_address": f"127.0.0.1:{kvtools.free_port()}"}, env={})
    t0 = time.monotonic()
    be = MooncakeBackend(cfg, retry_interval_s=60)
    assert time.monotonic() - t0 < 5 and not be.connected
    worker = build_worker(SPEC, PoolConfig.from_extra({}), be)
    try:
        caches = kvtools.make(num_blocks=8)
        worker.register_kv_caches(caches, 8)
        scheduler = build_scheduler(SPEC, PoolConfig.from_extra({}), worker.safe_lookup)
        with caplog.at_level(logging.WARNING, logger="ascend_dist.kv_store"):
            for i in range(3):
                assert scheduler.get_num_new_matched_tokens(f"r{i}", list(range(64)), 64, 0) == (0, False)
        assert len([r for r in caplog.records if "lookup failed" in r.getMessage()]) == 1
        with pytest.raises(StoreError, match="not connected"):
            be.exists(["k"])
    finally:
        worker.close()


def test_two_processes_share_the_pool_over_tcp(mooncake_master, kvtools) -> None:
    """A child instance saves a prompt; this instance looks it up over the ZMQ RPC and loads it byte-exact."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), mooncake_master.address, "7", "70"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    worker = server = client = None
    try:
        line = child.stdout.readline() if child.stdout else ""
        assert line.startswith("READY"), line
        digests = line.split()[1].split(",")
        cfg = PoolConfig.from_extra({})
        worker = build_worker(SPEC, cfg, backend_for(mooncake_master, contribute_memory=False))
        caches = kvtools.make(num_blocks=16, seed=3)
        worker.register_kv_caches(caches, 16)
        server = LookupServer(
            lambda r: worker.lookup(r.token_len, r.block_hashes, r.group_ids, r.hbm_hit_tokens),
            SPEC.compat_hash(),
            port=kvtools.free_port(),
        )
        client = LookupClient(  # over the RPC as from a scheduler process (same-process clients call directly)
            SPEC.compat_hash(), port=int(server.endpoint.rsplit(":", 1)[1]), timeout_s=5, in_process=False
        )
        scheduler = build_scheduler(SPEC, cfg, client.lookup)
        prompt = list(range(1000, 1070))
        need, _ = scheduler.get_num_new_matched_tokens("rb", prompt, 70, 0)
        assert need == 64
        blocks = [9, 10, 11, 12, 13]
        scheduler.update_state_after_alloc("rb", [blocks], need)
        meta = scheduler.build_meta(StepInput(new=[NewRequest("rb", prompt, [blocks], 64, 6)]))
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == set()
        got = [hashlib.sha256(kvtools.block_bytes(caches, b)).hexdigest() for b in blocks[:4]]
        assert got == digests
        # a scheduler with another key scheme is refused: zero hits, never a false hit
        other = LookupClient("0" * 64, port=int(server.endpoint.rsplit(":", 1)[1]), timeout_s=5)
        assert other.lookup(64, tuple(scheduler.hashes_for(prompt)[1])) == 0
        other.close()
    finally:
        for closer in (client, server, worker):
            if closer is not None:
                closer.close()
        if child.stdin:
            try:
                child.stdin.write("quit\n")
                child.stdin.flush()
            except BrokenPipeError:
                pass
        try:
            child.wait(timeout=20)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(5)
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()


def test_evicted_key_between_lookup_and_load(mooncake_master, kvtools) -> None:
    from mooncake.store import MooncakeDistributedStore

    cfg = PoolConfig.from_extra({})
    worker = build_worker(SPEC, cfg, backend_for(mooncake_master))
    admin = MooncakeDistributedStore()
    assert admin.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_master.address) == 0
    try:
        caches = kvtools.make(num_blocks=16, seed=5)
        worker.register_kv_caches(caches, 16)
        scheduler = build_scheduler(SPEC, cfg, worker.safe_lookup)
        prompt = list(range(5000, 5064))
        scheduler.get_num_new_matched_tokens("a", prompt, 64, 0)
        meta = scheduler.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3, 4]], 0, 64)]))
        worker.wait_for_save(meta)
        worker.drain(10)
        need, _ = scheduler.get_num_new_matched_tokens("b", prompt, 64, 0)
        assert need == 63
        victim = SPEC.key_metadata()[0].pool_key(scheduler.hashes_for(prompt)[1][1])
        assert admin.remove(victim, True) == 0  # force: the lookup's lease would refuse it (-706)
        scheduler.update_state_after_alloc("b", [[5, 6, 7, 8]], need)
        meta = scheduler.build_meta(StepInput(new=[NewRequest("b", prompt, [[5, 6, 7, 8]], 63, 1)]))
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == {6}
        assert kvtools.block_bytes(caches, 5) == kvtools.block_bytes(caches, 1)
    finally:
        admin.close()
        worker.close()


def test_master_restart_hits_again(fresh_master, kvtools) -> None:
    cfg = PoolConfig.from_extra({})
    worker = build_worker(SPEC, cfg, backend_for(fresh_master, retry_interval_s=0.5))
    try:
        caches = kvtools.make(num_blocks=16, seed=6)
        worker.register_kv_caches(caches, 16)
        scheduler = build_scheduler(SPEC, cfg, worker.safe_lookup)
        prompt = list(range(64))

        def save(req: str) -> None:
            scheduler.get_num_new_matched_tokens(req, prompt, 64, 0)
            meta = scheduler.build_meta(StepInput(new=[NewRequest(req, prompt, [[1, 2, 3, 4]], 0, 64)]))
            worker.wait_for_save(meta)
            worker.drain(20)

        save("a")
        assert scheduler.get_num_new_matched_tokens("b", prompt, 64, 0)[0] == 63
        fresh_master.stop()
        assert scheduler.get_num_new_matched_tokens("c", prompt, 64, 0) == (0, False)  # RPC_FAIL -> miss
        assert scheduler.get_num_new_matched_tokens("d", prompt, 64, 0) == (0, False)  # circuit open: fast
        fresh_master.start()
        deadline = time.monotonic() + 15
        hit = 0
        while time.monotonic() < deadline and hit == 0:
            time.sleep(0.5)
            save("e")  # the restarted master lost its metadata: the next save repopulates it
            hit = scheduler.get_num_new_matched_tokens("f", prompt, 64, 0)[0]
        assert hit == 63
    finally:
        worker.close()


def test_partial_last_chunk_is_pooled_under_its_own_key(mooncake_master, kvtools) -> None:
    """``discard_partial_chunks=false``: the prompt's tail chunk is saved and a repeat loads all of it."""
    cfg = PoolConfig.from_extra({"discard_partial_chunks": False})
    a = build_worker(SPEC, cfg, backend_for(mooncake_master))
    b = build_worker(SPEC, cfg, backend_for(mooncake_master))
    try:
        ca, cb = kvtools.make(num_blocks=16, seed=11), kvtools.make(num_blocks=16, seed=12)
        a.register_kv_caches(ca, 16)
        b.register_kv_caches(cb, 16)
        sa, sb = build_scheduler(SPEC, cfg, a.safe_lookup), build_scheduler(SPEC, cfg, b.safe_lookup)
        prompt = list(range(6000, 6040))  # 2 whole chunks + 8 tokens
        assert sa.get_num_new_matched_tokens("a", prompt, 40, 0) == (0, False)
        meta = sa.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3]], 0, 40)]))
        assert [m.save_end_token for m in meta.requests] == [40]
        a.wait_for_save(meta)
        a.drain(10)
        assert a.stats.saved_keys == 3 and a.stats.saved_bytes == (2 + 0.5) * 16 * 2 * 8 * 2 * 2 * 2
        need, _ = sb.get_num_new_matched_tokens("b", prompt, 40, 0)
        assert need == 39  # the whole prompt but its last token (vLLM computes the logits)
        sb.update_state_after_alloc("b", [[7, 8, 9]], need)
        b.start_load_kv(sb.build_meta(StepInput(new=[NewRequest("b", prompt, [[7, 8, 9]], 39, 1)])))
        assert b.get_block_ids_with_load_errors() == set()
        for name in ca:
            for kv in (0, 1):
                assert torch.equal(cb[name][kv][7:9], ca[name][kv][1:3])
                assert torch.equal(cb[name][kv][9][:8], ca[name][kv][3][:8])  # the partial tail
        # a longer prompt sharing the first 40 tokens reuses only the whole chunks
        assert sb.get_num_new_matched_tokens("c", [*prompt, 1, 2, 3], 43, 0)[0] == 32
        # a whole-chunk instance never reads the partial object
        plain = build_scheduler(SPEC, PoolConfig.from_extra({}), b.safe_lookup)
        assert plain.get_num_new_matched_tokens("d", prompt, 40, 0)[0] == 32
    finally:
        a.close()
        b.close()


def test_loads_from_a_killed_master_are_peer_unreachable_failures_with_no_bytes(fresh_master, kvtools) -> None:
    """Transfer stats (issue 26): the store's process is gone between the lookup and the load."""
    from ascend_dist.common.transfer_stats import TransferStats

    cfg = PoolConfig.from_extra({})
    stats = TransferStats("pool")
    worker = build_worker(SPEC, cfg, backend_for(fresh_master, retry_interval_s=30.0), transfer_stats=stats)
    try:
        caches = kvtools.make(num_blocks=16, seed=21)
        worker.register_kv_caches(caches, 16)
        scheduler = build_scheduler(SPEC, cfg, worker.safe_lookup)
        prompt = list(range(7000, 7064))
        scheduler.get_num_new_matched_tokens("a", prompt, 64, 0)
        worker.wait_for_save(scheduler.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3, 4]], 0, 64)])))
        worker.drain(10)
        saved = stats.take()
        assert saved is not None and not saved.failures
        assert sum(t.nbytes for t in saved.transfers) == sum(len(kvtools.block_bytes(caches, b)) for b in (1, 2, 3, 4))
        need, _ = scheduler.get_num_new_matched_tokens("b", prompt, 64, 0)
        assert need == 63  # control: the pool holds the prompt
        scheduler.update_state_after_alloc("b", [[5, 6, 7, 8]], need)
        meta = scheduler.build_meta(StepInput(new=[NewRequest("b", prompt, [[5, 6, 7, 8]], 63, 1)]))
        fresh_master.kill()
        worker.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == {5, 6, 7, 8}
        failed = stats.take()
        assert failed is not None and not failed.transfers  # nothing moved, nothing reported as moved
        assert {(f.direction, f.kind.value) for f in failed.failures} == {("load", "peer_unreachable")}
        assert sum(f.count for f in failed.failures) == 4  # one per object
    finally:
        worker.close()
