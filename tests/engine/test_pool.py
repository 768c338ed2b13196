"""`AscendStoreConnector` between real vLLM engines: a second engine reuses the prefixes a first one pooled.

Two engines share a real store — a ``mooncake_master`` started by the project's own launcher, or a
real openYuanrong ``datasystem_worker`` — and never talk to each other. The first engine computes
each prompt (a miss) and saves its full chunks; the second looks the prompt up, loads the chunks
into its paged KV cache and computes only the tail. Checks per mode (synchronous loads,
``load_async``, ``use_layerwise``; and openYuanrong): the second engine's external hits
(`num_cached_tokens`) are every full chunk, its output equals the no-connector reference, and the
control — the first engine on model "b" (other weights, same name, hence the same pool keys) —
changes every output of the second, so it really decoded the pool's bytes.

The engines of one mode live in one test class (class-scoped fixtures), so at most three run at once.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.wire import Completion, EngineSpec
from ascend_dist.kv_store.master_process import MasterProcess, free_port
from ascend_dist.testing.engines import (
    POOL_LENGTHS,
    assert_every_output_differs,
    assert_same_output,
    expected_hits,
    full_chunks,
    local,
    make_prompts,
    master_key_count,
    mooncake_store_config,
    pool_config,
    wait_for_keys,
)
from ascend_dist.testing.ports import wait_port

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

NUM_LAYERS = 4  # the tier's tiny Llama: layer-wise mode stores one object per chunk and layer


def pooled_then_loaded(
    writer: Engine, reader: Engine, prompts: Sequence[Sequence[int]], settle: Any
) -> tuple[list[Completion], list[Completion]]:
    """The writer computes and pools ``prompts``; once ``settle`` says they are stored, the reader runs them."""
    written = writer.generate(local(prompts))
    assert [c.num_cached_tokens for c in written] == [0] * len(prompts), "the writer hit a pool that should be empty"
    settle()
    return written, reader.generate(local(prompts))


def check_reuse(
    writer: Engine, reader: Engine, reference: Engine, prompts: Sequence[Sequence[int]], settle: Any
) -> None:
    written, read = pooled_then_loaded(writer, reader, prompts, settle)
    want = reference.generate(local(prompts))
    assert_same_output(written, want)
    assert [c.num_cached_tokens for c in read] == expected_hits(prompts), "the reader did not load every full chunk"
    assert_same_output(read, want)


def check_control(
    writer_b: Engine, reader: Engine, reference: Engine, prompts: Sequence[Sequence[int]], settle: Any
) -> None:
    """Chunks pooled by model "b" under model "a"'s keys: a reader that used them must change every output."""
    _, read = pooled_then_loaded(writer_b, reader, prompts, settle)
    assert [c.num_cached_tokens for c in read] == expected_hits(prompts)
    assert_every_output_differs(read, reference.generate(local(prompts)))


def spawn_pool(host: EngineHost, model: Path, config: dict[str, Any], name: str) -> Engine:
    return host.spawn(EngineSpec(model=str(model), kv_transfer_config=config), name)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MasterProcess]:
    """One real ``mooncake_master`` for the module's Mooncake engines."""
    proc = MasterProcess(log_path=tmp_path_factory.mktemp("mooncake") / "master.log")
    proc.start()
    yield proc
    proc.stop()


class MooncakeSettle:
    """`settle` for Mooncake: wait until the master holds every object written so far."""

    def __init__(self, master: MasterProcess, objects_per_chunk: int) -> None:
        self.master = master
        self.per_chunk = objects_per_chunk

    def after(self, prompts: Sequence[Sequence[int]]) -> Any:
        want = master_key_count(self.master) + full_chunks(prompts) * self.per_chunk
        return lambda: wait_for_keys(self.master, want)


class TestMooncakeWholeRequest:
    """Whole-request mode: one object per chunk; synchronous and asynchronous loads.

    Two "a" engines (one loading synchronously, one with ``load_async``) each write what the other
    reads; the "b" engine writes for the control.
    """

    @pytest.fixture(scope="class")
    @staticmethod
    def engines(host: EngineHost, models: dict[str, Path], master: MasterProcess) -> Iterator[dict[str, Engine]]:
        store = mooncake_store_config(master.address)
        spawned: dict[str, Engine] = {}
        try:
            spawned["sync"] = spawn_pool(host, models["a"], pool_config("mooncake", store), "pool-sync")
            spawned["async"] = spawn_pool(
                host, models["a"], pool_config("mooncake", store, load_async=True), "pool-async"
            )
            spawned["b"] = spawn_pool(host, models["b"], pool_config("mooncake", store), "pool-b")
            yield spawned
        finally:
            for engine in spawned.values():
                engine.close()

    @pytest.mark.parametrize("case", [("sync", "async", 1101), ("async", "sync", 1102)], ids=["sync", "async"])
    def test_second_engine_loads_the_pooled_prefixes(
        self, engines: dict[str, Engine], master: MasterProcess, reference: Engine, case: tuple[str, str, int]
    ) -> None:
        reader, writer, seed = case  # the reader's load mode; the other engine writes
        prompts = make_prompts(seed, POOL_LENGTHS)
        settle = MooncakeSettle(master, 1).after(prompts)
        check_reuse(engines[writer], engines[reader], reference, prompts, settle)

    @pytest.mark.parametrize(("reader", "seed"), [("sync", 1201), ("async", 1202)], ids=["sync", "async"])
    def test_control_writer_on_other_weights_changes_every_output(
        self, engines: dict[str, Engine], master: MasterProcess, reference: Engine, reader: str, seed: int
    ) -> None:
        prompts = make_prompts(seed, POOL_LENGTHS)
        settle = MooncakeSettle(master, 1).after(prompts)
        check_control(engines["b"], engines[reader], reference, prompts, settle)


class TestMooncakeLayerwise:
    """``use_layerwise``: one object per chunk and layer, each layer loaded around its attention."""

    @pytest.fixture(scope="class")
    @staticmethod
    def engines(host: EngineHost, models: dict[str, Path], master: MasterProcess) -> Iterator[dict[str, Engine]]:
        store = mooncake_store_config(master.address)
        spawned: dict[str, Engine] = {}
        try:
            for name, model in (("writer", "a"), ("reader", "a"), ("b", "b")):
                config = pool_config("mooncake", store, use_layerwise=True)
                spawned[name] = spawn_pool(host, models[model], config, f"pool-layerwise-{name}")
            yield spawned
        finally:
            for engine in spawned.values():
                engine.close()

    def test_second_engine_loads_the_pooled_prefixes(
        self, engines: dict[str, Engine], master: MasterProcess, reference: Engine
    ) -> None:
        prompts = make_prompts(1301, POOL_LENGTHS)
        settle = MooncakeSettle(master, NUM_LAYERS).after(prompts)
        check_reuse(engines["writer"], engines["reader"], reference, prompts, settle)

    def test_control_writer_on_other_weights_changes_every_output(
        self, engines: dict[str, Engine], master: MasterProcess, reference: Engine
    ) -> None:
        prompts = make_prompts(1302, POOL_LENGTHS)
        settle = MooncakeSettle(master, NUM_LAYERS).after(prompts)
        check_control(engines["b"], engines["reader"], reference, prompts, settle)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Three prompts over one 96-token prefix (3 chunks), with tails of their own (the last fills a 4th chunk)."""
    prefix, *tails = make_prompts(seed, (96, 13, 20, 45))
    return [prefix + tail for tail in tails]


class TestMooncakeSharedPrefixOneBatch:
    """Issue 21: the reader, prefix caching OFF, gets three prompts sharing a pooled prefix in one batch.

    vLLM gives each request its own blocks for the shared chunks, so one synchronous load step holds
    each pooled chunk three times; a batch get that repeats a key writes only its last destination.
    The writer pools the prompts first (4 distinct chunks: the shared 3 and the last prompt's 4th).
    """

    @pytest.fixture(scope="class")
    @staticmethod
    def engines(host: EngineHost, models: dict[str, Path], master: MasterProcess) -> Iterator[dict[str, Engine]]:
        store = mooncake_store_config(master.address)
        spawned: dict[str, Engine] = {}
        try:
            # the writers too: with vLLM's prefix cache their second and third prompts would hit the first's blocks
            for name, model in (("writer", "a"), ("reader", "a"), ("b", "b")):
                spec = EngineSpec(
                    model=str(models[model]), kv_transfer_config=pool_config("mooncake", store),
                    enable_prefix_caching=False,
                )  # fmt: skip
                spawned[name] = host.spawn(spec, f"pool-shared-{name}")
            yield spawned
        finally:
            for engine in spawned.values():
                engine.close()

    @staticmethod
    def settle(master: MasterProcess) -> Any:
        want = master_key_count(master) + 4  # distinct chunks of `shared_prefix_prompts`
        return lambda: wait_for_keys(master, want)

    def test_reader_loads_the_shared_prefix_for_every_request_of_a_batch(
        self, engines: dict[str, Engine], master: MasterProcess, reference: Engine
    ) -> None:
        prompts = shared_prefix_prompts(1501)
        check_reuse(engines["writer"], engines["reader"], reference, prompts, self.settle(master))

    def test_control_writer_on_other_weights_changes_every_output(
        self, engines: dict[str, Engine], master: MasterProcess, reference: Engine
    ) -> None:
        prompts = shared_prefix_prompts(1502)
        check_control(engines["b"], engines["reader"], reference, prompts, self.settle(master))


# ---- openYuanrong -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def yuanrong_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real openYuanrong ``datasystem_worker`` with its built-in metastore, started by ``dscli``; its address."""
    local_dscli = Path(sys.executable).parent / "dscli"
    dscli = str(local_dscli) if local_dscli.exists() else shutil.which("dscli")
    if dscli is None:
        pytest.fail("dscli not installed: the engine environment must provide openyuanrong-datasystem")
    home = tmp_path_factory.mktemp("yuanrong")
    port = free_port()
    address = f"127.0.0.1:{port}"
    stop = [dscli, "stop", "-w", address]
    start = [
        dscli, "start", "-d", str(home / "home"), "-w", "--worker_address", address,
        "--metastore_address", f"127.0.0.1:{free_port()}", "--start_metastore_service", "true",
        "--shared_memory_size_mb", "256",
    ]  # fmt: skip
    res = subprocess.run(start, capture_output=True, text=True, timeout=120, check=False)
    try:
        if res.returncode != 0 or not wait_port(port, 30, poll_s=0.1):
            pytest.fail(f"openYuanrong worker did not start: {res.stdout[-1500:]} {res.stderr[-1500:]}")
        yield address
    finally:
        subprocess.run(stop, capture_output=True, timeout=60, check=False)


class TestYuanrong:
    """The same over an openYuanrong worker (the backend imports Mooncake first: the reverse order segfaults)."""

    @pytest.fixture(scope="class")
    @staticmethod
    def engines(host: EngineHost, models: dict[str, Path], yuanrong_worker: str) -> Iterator[dict[str, Engine]]:
        config = pool_config("yuanrong", {"worker_addr": yuanrong_worker})
        spawned: dict[str, Engine] = {}
        try:
            for name, model in (("writer", "a"), ("reader", "a"), ("b", "b")):
                spawned[name] = spawn_pool(host, models[model], config, f"pool-yuanrong-{name}")
            yield spawned
        finally:
            for engine in spawned.values():
                engine.close()

    @staticmethod
    def settle() -> None:
        # openYuanrong has no object counter to poll: give the writer's save thread a bounded moment
        # (a late save shows as a shorter hit and fails the hit assertion, never a false pass).
        time.sleep(2.0)

    def test_second_engine_loads_the_pooled_prefixes(self, engines: dict[str, Engine], reference: Engine) -> None:
        check_reuse(engines["writer"], engines["reader"], reference, make_prompts(1401, POOL_LENGTHS), self.settle)

    def test_control_writer_on_other_weights_changes_every_output(
        self, engines: dict[str, Engine], reference: Engine
    ) -> None:
        check_control(engines["b"], engines["reader"], reference, make_prompts(1402, POOL_LENGTHS), self.settle)
