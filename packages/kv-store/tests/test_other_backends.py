"""openYuanrong against a real worker; memcache's typed error; the lookup RPC's failure paths."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ascend_dist.common.errors import StoreError
from ascend_dist.kv_store import (
    LookupClient,
    LookupServer,
    NewRequest,
    PoolConfig,
    PoolSpec,
    StepInput,
    build_scheduler,
    build_worker,
    create_backend,
)
from ascend_dist.kv_store.backends import PoolBackend
from ascend_dist.kv_store.backends.memcache import MemcacheBackend, MemcacheUnavailable
from ascend_dist.kv_store.backends.yuanrong import YuanrongBackend
from ascend_dist.kv_store.config.config import YuanrongConfig
from ascend_dist.kv_store.lookup.lookup_endpoint import endpoint_dir

SPEC = PoolSpec(model="tiny", block_sizes=(16,), num_kv_heads=2)


def test_yuanrong_backend_round_trip(yuanrong_worker) -> None:
    be = create_backend("yuanrong", backend_config={"worker_addr": yuanrong_worker.address})
    assert isinstance(be, YuanrongBackend) and isinstance(be, PoolBackend)
    src = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    key = f"tiny@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@group:0@cache_role:kv@cache_family:default@{time.time_ns():x}"
    assert be.put([key], [[s, s + 2048]], [[1024, 1024]]) == [0]
    assert be.exists([key, key + "-missing"]) == [1, 0]
    assert be.get([key, key + "-missing"], [[d], [d + 2048]], [[2048], [16]]) == [0, -704]
    assert bytes(dst[:1024]) == bytes(src[:1024]) and bytes(dst[1024:2048]) == bytes(src[2048:3072])
    assert be.get([key], [[d]], [[100]]) == [-600]


def test_pool_over_yuanrong(yuanrong_worker, kvtools) -> None:
    cfg = PoolConfig.from_extra({"backend": "yuanrong"})
    spec = PoolSpec(model="tiny-yr", block_sizes=(16,), num_kv_heads=2)
    w_a = build_worker(spec, cfg, create_backend("yuanrong", backend_config={"worker_addr": yuanrong_worker.address}))
    w_b = build_worker(spec, cfg, create_backend("yuanrong", backend_config={"worker_addr": yuanrong_worker.address}))
    try:
        ca, cb = kvtools.make(num_blocks=8, seed=11), kvtools.make(num_blocks=8, seed=12)
        w_a.register_kv_caches(ca, 8)
        w_b.register_kv_caches(cb, 8)
        s_a, s_b = build_scheduler(spec, cfg, w_a.safe_lookup), build_scheduler(spec, cfg, w_b.safe_lookup)
        prompt = [time.time_ns() % 100000, *range(47)]
        s_a.get_num_new_matched_tokens("a", prompt, 48, 0)
        w_a.wait_for_save(s_a.build_meta(StepInput(new=[NewRequest("a", prompt, [[1, 2, 3]], 0, 48)])))
        w_a.drain(10)
        need, _ = s_b.get_num_new_matched_tokens("b", prompt, 48, 0)
        assert need == 47
        s_b.update_state_after_alloc("b", [[4, 5, 6]], need)
        w_b.start_load_kv(s_b.build_meta(StepInput(new=[NewRequest("b", prompt, [[4, 5, 6]], 47, 1)])))
        assert w_b.get_block_ids_with_load_errors() == set()
        assert [kvtools.block_bytes(cb, b) for b in (4, 5, 6)] == [kvtools.block_bytes(ca, b) for b in (1, 2, 3)]
    finally:
        w_a.close()
        w_b.close()


def test_yuanrong_unreachable_is_a_store_error(kvtools) -> None:
    with pytest.raises(StoreError, match="unreachable"):
        YuanrongBackend(YuanrongConfig(host="127.0.0.1", port=kvtools.free_port(), connect_timeout_ms=300))


def test_memcache_without_driver_is_a_typed_error() -> None:
    with pytest.raises(MemcacheUnavailable, match=r"Ascend driver|not installed"):
        create_backend("memcache")


class FakeMemcacheStore:
    """A fake of our own `MemcacheStore` Protocol: a dict, directions recorded."""

    def __init__(self, init_rc: int = 0) -> None:
        self.init_rc = init_rc
        self.objects: dict[str, list[int]] = {}
        self.directions: list[int] = []
        self.registered: list[tuple[int, int]] = []

    def init(self, local_rank: int, init_bm: bool = True) -> int:
        return self.init_rc

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1 if k in self.objects else 0 for k in keys]

    def batch_put_from_layers(self, keys, addrs, sizes, direction) -> list[int]:
        self.directions.append(direction)
        for k, s in zip(keys, sizes, strict=True):
            self.objects[k] = s
        return [0] * len(keys)

    def batch_get_into_layers(self, keys, addrs, sizes, direction) -> list[int]:
        self.directions.append(direction)
        return [0 if self.objects.get(k) == s else -3101 for k, s in zip(keys, sizes, strict=True)]

    def close(self) -> None:
        pass


def test_memcache_through_the_protocol() -> None:
    fake = FakeMemcacheStore()
    be = MemcacheBackend(store_factory=lambda: fake)
    be.register_buffer([4096], [8192])
    assert be.put(["k"], [[4096]], [[64]]) == [0]
    assert be.exists(["k", "x"]) == [1, 0]
    assert be.get(["k", "x"], [[4096]] * 2, [[64]] * 2) == [0, -3101]
    assert fake.directions == [0, 1] and fake.registered == [(4096, 8192)]
    with pytest.raises(MemcacheUnavailable, match="returned -1"):
        MemcacheBackend(store_factory=lambda: FakeMemcacheStore(init_rc=-1))


def test_lookup_client_dead_server_is_a_bounded_miss(kvtools, caplog) -> None:
    client = LookupClient(SPEC.compat_hash(), port=kvtools.free_port(), timeout_s=0.2)
    try:
        t0 = time.monotonic()
        assert client.lookup(64, (b"x" * 32,) * 4) == 0
        assert time.monotonic() - t0 < 2 and client.failures == 1
    finally:
        client.close()


def test_lookup_endpoint_file_discovery(tmp_path) -> None:
    env = {"VLLM_RPC_BASE_PATH": str(tmp_path)}
    server = LookupServer(lambda r: r.token_len // 2, "c" * 64, dp_rank=1, instance="engine-a", env=env)
    try:
        client = LookupClient("c" * 64, dp_rank=1, instance="engine-a", env=env, timeout_s=2)
        assert client.lookup(64, ()) == 32
        other = LookupClient("c" * 64, dp_rank=0, instance="engine-a", env=env)
        assert other.lookup(64, ()) == 0  # other engine: not published
        client.close()
        other.close()
    finally:
        server.close()
    assert [p.name for p in tmp_path.iterdir()] == [endpoint_dir(env).name]  # the private directory stays
    assert not list(endpoint_dir(env).iterdir())  # the file is gone


def test_lookup_server_survives_a_raising_lookup(kvtools) -> None:
    calls = []

    def lookup(req) -> int:
        calls.append(req)
        if len(calls) == 1:
            raise StoreError("boom")
        return 16

    server = LookupServer(lookup, "c" * 64, port=kvtools.free_port())
    client = LookupClient("c" * 64, port=int(server.endpoint.rsplit(":", 1)[1]), timeout_s=2)
    try:
        assert client.lookup(32, ()) == 0
        assert client.lookup(32, ()) == 16
    finally:
        client.close()
        server.close()
