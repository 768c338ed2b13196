"""Bench scenario ``pool-vllm``: our pool connector beside vLLM's ``MooncakeStoreConnector``, both driven by vLLM.

Runs in: the ``ascend-dist bench`` process; starts one ``mooncake_master`` per connector on
127.0.0.1 and stops them. Needs vLLM (0.33; the ``[vllm]`` extra) and Mooncake (the ``[cpu]`` extra):
without them the scenario fails at once, saying what to install.

For each contender, two instances (A and B) over its own master, each a vLLM ``Scheduler`` plus a
worker connector from vLLM's factory over CPU caches (`vllm_driver`), in each connector's default
load mode (ours: synchronous, vLLM's: ``load_async``). The contenders: ours over Ascend's split
(K, V) caches (what vllm-ascend registers; 2 pieces per layer and chunk), vLLM's connector over
vLLM 0.33's one tensor per layer (what it requires; 1 piece), and ours over vLLM's layout too (the
same pieces as vLLM's; informative, no target). Ours runs with ``preferred_segment`` (A's puts go
into A's own segment: a memory copy; B then reads every object over TCP); vLLM's with its defaults
(the master places each put in either instance's segment, so about half of its puts and of its
loads are local copies). After one warm-up round (verified, not timed:
first touch of the segments), per round and contender (which runs first rotates per round):

1. A is sent ``requests`` prompts of ``chunks`` whole blocks; **store GB/s** = their whole chunks'
   bytes / the time from A's first step until vLLM's scheduler has nothing left to do
   (``Scheduler.has_requests``: ours holds finished requests' blocks until their saves complete,
   vLLM's pins them until its save jobs report back).
2. B is sent the same prompts; **load GB/s** = the same bytes / the time from B's first step until
   every request's KV is in B's cache as vLLM sees it (synchronous: ``start_load_kv`` of the step
   that schedules them returned; asynchronous: ``get_transfer_results`` reported them).
3. Every loaded block is compared byte for byte with A's block of the same request and chunk. B's
   caches hold a sentinel before the load and A's hold fresh random bytes, so a connector that moved
   nothing, or the wrong blocks, fails the round and no figure is reported for it.

Figures are the best round of each contender (the 2-core machine is shared); ratios are ours /
vLLM's, with the issue's target of 1.5x for ours on Ascend's layout.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.kv_store._demo.bench_geometry import FULL, QUICK, Geometry
from ascend_dist.kv_store.master_process import MasterProcess, free_port

if TYPE_CHECKING:
    from ascend_dist.kv_store._demo.vllm_driver import Cache, Instance

__all__ = ["FULL", "QUICK", "PoolVllmScenario", "make_scenario"]

TARGET_RATIO = 1.5
PHASE_TIMEOUT_S = 120.0
OURS = "ours (AscendStoreConnector), Ascend split K/V"
OURS_VLLM_LAYOUT = "ours (AscendStoreConnector), vLLM's layout"
PEER = "vLLM MooncakeStoreConnector"


def missing_requirements() -> str | None:
    """What to install when vLLM or Mooncake is absent, else None (looks, never imports)."""
    if importlib.util.find_spec("vllm") is None:
        return "pool-vllm needs vLLM: pip install 'ascend-dist-kv-store[vllm]' (vllm>=0.32,<0.34)"
    if importlib.util.find_spec("mooncake") is None:
        return "pool-vllm needs Mooncake: pip install 'ascend-dist-kv-store[cpu]' (and libibverbs1)"
    return None


@dataclass(frozen=True)
class Contender:
    """A connector under test: its vLLM name and module, and the cache layout its runner registers."""

    label: str
    connector: str
    module: str | None
    peer: bool  # vLLM's: store settings from MOONCAKE_CONFIG_PATH; ours: inline ``store_config``
    split_kv: bool  # (K, V) per layer, as vllm-ascend's runner; else vLLM 0.33's one tensor per layer
    target: float | None = None


_OURS_MODULE = "ascend_dist.kv_store.vllm_connector"
CONTENDERS = (
    Contender(OURS, "AscendStoreConnector", _OURS_MODULE, peer=False, split_kv=True, target=TARGET_RATIO),
    Contender(PEER, "MooncakeStoreConnector", None, peer=True, split_kv=False),
    Contender(OURS_VLLM_LAYOUT, "AscendStoreConnector", _OURS_MODULE, peer=False, split_kv=False),
)


@dataclass
class _Side:
    """One connector's two instances, its master and its results."""

    contender: Contender
    master: MasterProcess
    a: Instance
    b: Instance
    admin: Any
    store_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    verified: bool = True


@dataclass
class _Round:
    store_s: float
    load_s: float
    problems: list[str]


class PoolVllmScenario:
    """The ``pool-vllm`` bench scenario."""

    name = "pool-vllm"
    summary = "pool store/load GB/s through vLLM's Scheduler: ours vs vLLM's MooncakeStoreConnector (default modes)"
    modes = frozenset({"bench"})

    def __init__(
        self,
        *,
        geometry: Geometry | None = None,
        rounds: int | None = None,
        ours_b_extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Defaults: `FULL` (`QUICK` with ``--quick``), ``ctx.repeat`` rounds (1 with ``--quick``).

        ``ours_b_extra`` is merged into our instance B's ``kv_connector_extra_config`` (its
        ``store_config`` key by key): tests point B's loads elsewhere to prove the check fails.
        """
        self._geometry = geometry
        self._rounds = rounds
        self._ours_b_extra = dict(ours_b_extra or {})

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Run every round for every contender, verify every loaded byte, report best-round figures."""
        report = ScenarioReport(self.name, ctx.mode)
        missing = missing_requirements()
        if missing is not None:
            report.error = missing
            return report
        geo = self._geometry or (QUICK if ctx.quick else FULL)
        rounds = self._rounds or (1 if ctx.quick else max(1, ctx.repeat))
        with tempfile.TemporaryDirectory(prefix="pool-vllm-") as tmp:
            self._run(ctx, report, geo, rounds, Path(tmp))
        return report

    def _run(self, ctx: ScenarioContext, report: ScenarioReport, geo: Geometry, rounds: int, tmp: Path) -> None:
        from ascend_dist.kv_store._demo import vllm_driver as vd

        contenders = CONTENDERS
        model_dir = vd.write_model_dir(tmp, geo)
        (tmp / "rpc").mkdir(mode=0o700)
        env = {
            "VLLM_RPC_BASE_PATH": str(tmp / "rpc"),  # both connectors' lookup endpoints, private to this run
            "VLLM_HOST_IP": "127.0.0.1",  # vLLM's Mooncake client registers this host
            "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_CONFIG_PATH": None,  # set per instance below; never inherited
            "MOONCAKE_MASTER": None,  # would override ours' master
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": None,
            "HF_HUB_OFFLINE": "1",
        }
        sides: list[_Side] = []
        ctx.progress.step(
            f"{geo.requests} prompts x {geo.chunks} chunks of {geo.chunk_bytes >> 10} KiB "
            f"({geo.layers} layers x {geo.kv_heads} KV heads x {geo.head_dim}, block {geo.block}), {rounds} round(s)"
        )
        with vd.environment(env):
            probe = vd.vllm_config(model_dir, geo, self._ktc(contenders[0], free_port(), "127.0.0.1:1"))
            with vd.distributed_env(probe, free_port()):
                try:
                    for c in contenders:
                        ctx.progress.step(f"starting mooncake_master and instances A, B for {c.label}")
                        sides.append(self._start(c, geo, model_dir, tmp))
                    gc.collect()
                    gc.freeze()  # as vLLM's engine does after start-up: collections scan only what steps allocate
                    for side in sides:
                        ctx.progress.step(f"warm-up round: {side.contender.label}")
                        self._round(report, side, geo, -1)
                    for r in range(rounds):
                        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                            ctx.progress.step(f"round {r + 1}/{rounds}: {side.contender.label}")
                            self._round(report, side, geo, r)
                finally:
                    gc.unfreeze()
                    for side in sides:
                        self._stop(side)
        self._measure(report, geo, sides)

    def _ktc(self, c: Contender, port: int, master: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """``KVTransferConfig`` fields of one instance (the driver builds it: only vllm_* modules import vLLM)."""
        config: dict[str, Any] = {"lookup_rpc_port": port}
        if not c.peer:
            # ours puts into the saving worker's own segment (a memory copy); vLLM's connector can
            # only name a fixed segment, and P2PHANDSHAKE segment names carry a port chosen at setup
            store = self._store_settings(master, 0) | {"preferred_segment": True}
            config |= {"backend": "mooncake", "store_config": store}
        for key, value in (extra or {}).items():
            config[key] = {**config[key], **value} if key == "store_config" else value
        return {
            "kv_connector": c.connector,
            "kv_role": "kv_both",
            "kv_connector_module_path": c.module,
            "kv_connector_extra_config": config,
        }

    @staticmethod
    def _store_settings(master: str, segment: int) -> dict[str, Any]:
        """The same Mooncake client settings for both connectors (vLLM's reads them from a file)."""
        return {
            "metadata_server": "P2PHANDSHAKE",
            "master_server_address": master,
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",  # ours; vLLM's takes VLLM_HOST_IP / MOONCAKE_REQUESTER_LOCAL_HOSTNAME
            "device_name": "",
            "global_segment_size": segment,
            "local_buffer_size": 64 << 20,
        }

    def _start(self, c: Contender, geo: Geometry, model_dir: Path, tmp: Path) -> _Side:
        from mooncake.store import MooncakeDistributedStore

        from ascend_dist.kv_store._demo import vllm_driver as vd

        master = MasterProcess()
        master.start()
        instances: list[Instance] = []
        admin = None
        try:
            # Each instance's segment holds a whole round: A's puts land in either segment.
            segment = geo.round_bytes + (32 << 20)
            settings = self._store_settings(master.address, segment)
            for name in ("a", "b"):
                extra: dict[str, Any] = {"store_config": {"global_segment_size": segment}} if not c.peer else {}
                if name == "b" and not c.peer:
                    extra |= {k: v for k, v in self._ours_b_extra.items() if k != "store_config"}
                    extra["store_config"] |= dict(self._ours_b_extra.get("store_config", {}))
                config = vd.vllm_config(model_dir, geo, self._ktc(c, free_port(), master.address, extra))
                mooncake_json = tmp / f"mooncake-{master.port}-{name}.json"
                mooncake_json.write_text(json.dumps(settings))
                with vd.environment({"MOONCAKE_CONFIG_PATH": str(mooncake_json) if c.peer else None}):
                    instances.append(vd.Instance(config, geo, vd.make_caches(geo, split_kv=c.split_kv)))
            admin = MooncakeDistributedStore()
            if admin.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) != 0:
                raise RuntimeError(f"admin Mooncake client could not reach {master.address}")
        except BaseException:
            for inst in instances:
                inst.close()
            if admin is not None:
                admin.close()
            master.stop()
            raise
        return _Side(c, master, instances[0], instances[1], admin)

    @staticmethod
    def _stop(side: _Side) -> None:
        try:
            side.a.close()
            side.b.close()
            side.admin.close()
        finally:
            side.master.stop()

    def _round(self, report: ScenarioReport, side: _Side, geo: Geometry, r: int) -> None:
        label = side.contender.label
        salt = CONTENDERS.index(side.contender) if side.contender in CONTENDERS else len(CONTENDERS)
        prompts = [_prompt(geo, r, i, salt) for i in range(geo.requests)]
        result = _run_round(side, geo, prompts, r)
        ok = report.check(
            f"{label} {'warm-up round' if r < 0 else f'round {r + 1}'}: every chunk loaded byte-exact",
            not result.problems,
            "; ".join(result.problems[:3])
            or f"{geo.requests} requests x {geo.chunks} chunks = {_size(geo.round_bytes)}, store "
            f"{geo.round_bytes / result.store_s / 1e9:.3f} GB/s, load {geo.round_bytes / result.load_s / 1e9:.3f} GB/s",
        )
        if not ok:
            side.verified = False
        elif r >= 0:
            side.store_s.append(result.store_s)
            side.load_s.append(result.load_s)
        side.admin.remove_all(True)  # next round starts from an empty pool (leases ignored)

    @staticmethod
    def _measure(report: ScenarioReport, geo: Geometry, sides: list[_Side]) -> None:
        """Best round of each of ours beside vLLM's; a contender that failed any round gets no figure."""
        (peer,) = [s for s in sides if s.contender.peer]
        if not (peer.verified and peer.store_s):
            return
        what = f"{_size(geo.round_bytes)}: {geo.requests} x {geo.chunks} chunks of {_size(geo.chunk_bytes)}"
        for ours in (s for s in sides if not s.contender.peer and s.verified and s.store_s):
            for figure, mine, theirs in (("store", ours.store_s, peer.store_s), ("load", ours.load_s, peer.load_s)):
                report.measurements.append(
                    Measurement(
                        f"{figure} {what}: {ours.contender.label}",
                        geo.round_bytes / min(mine) / 1e9,
                        "GB/s",
                        geo.round_bytes / min(theirs) / 1e9,
                        f"{PEER} (vLLM's layout, load_async), same run",
                        target_ratio=ours.contender.target,
                    )
                )


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def _prompt(geo: Geometry, r: int, i: int, salt: int) -> list[int]:
    """Distinct per round, request and contender: no hit in B's own vLLM prefix cache, none across requests.

    Contenders never share a store in the bench; distinct prompts keep it so when a test points two
    of them at one store.
    """
    base = 1 + ((r * 1009 + i + salt * 101) * 104_729) % 500_000
    return [base + t for t in range(geo.prompt_tokens)]


def _fill(caches: Mapping[str, Cache], value: float | None, seed: int) -> None:
    """Random bytes (``value`` None) or a constant in every block."""
    import torch

    from ascend_dist.kv_store._demo.vllm_driver import tensors

    gen = torch.Generator().manual_seed(seed)
    for t in tensors(dict(caches)):
        if value is None:
            t.view(torch.int16).copy_(torch.randint(-32768, 32767, t.shape, generator=gen, dtype=torch.int16))
        else:
            t.fill_(value)


def _run_round(side: _Side, geo: Geometry, prompts: list[list[int]], r: int) -> _Round:
    """Phase 1 (A stores), phase 2 (B loads), then the byte comparison."""
    a, b = side.a, side.b
    _fill(a.caches, None, seed=1000 + r)  # A's "computed" KV: fresh random bytes in every block
    _fill(b.caches, -3.0, seed=0)  # what B's blocks hold before a load: must not survive it
    sentinel = b.block(0)  # vLLM's null block: never allocated, keeps the fill
    problems: list[str] = []
    ids_a = [f"r{r}-a{i}" for i in range(len(prompts))]
    ids_b = [f"r{r}-b{i}" for i in range(len(prompts))]
    store_s, blocks_a = _store_phase(a, ids_a, prompts, problems)
    load_s, blocks_b = _load_phase(b, ids_b, prompts, problems)
    want = geo.chunks * geo.block
    for i, (ra, rb) in enumerate(zip(ids_a, ids_b, strict=True)):
        computed, blocks = blocks_b.get(rb, (0, []))
        if computed != want:
            problems.append(f"request {i}: vLLM counted {computed} loaded tokens, expected {want}")
            continue
        src = blocks_a.get(ra, [])
        for j in range(geo.chunks):
            got = b.block(blocks[j])
            if got == sentinel or j >= len(src) or got != a.block(src[j]):
                problems.append(f"request {i} chunk {j}: B's block differs from A's")
                break
    return _Round(store_s, load_s, problems)


def _store_phase(
    a: Instance, ids: list[str], prompts: list[list[int]], problems: list[str]
) -> tuple[float, dict[str, list[int]]]:
    """A computes every prompt; seconds from its first step until vLLM's scheduler is idle (saves done)."""
    for rid, p in zip(ids, prompts, strict=True):
        a.add(rid, p)
    t0 = time.perf_counter()
    first = a.step()
    a.run_until_idle(PHASE_TIMEOUT_S)
    store_s = time.perf_counter() - t0
    blocks = {rid: first.new_blocks[rid][1] for rid in ids if rid in first.new_blocks}
    if len(blocks) != len(ids):
        problems.append(f"A scheduled {len(blocks)}/{len(ids)} requests in its first step")
    return store_s, blocks


def _load_phase(
    b: Instance, ids: list[str], prompts: list[list[int]], problems: list[str]
) -> tuple[float, dict[str, tuple[int, list[int]]]]:
    """B admits every prompt; seconds from its first step until every hit is in its cache as vLLM sees it.

    A synchronous load is in place when ``start_load_kv`` of the step scheduling the request
    returned; an asynchronous one when ``get_transfer_results`` reported it. Returns the seconds
    and, per request that got loaded KV, vLLM's computed tokens at scheduling and its block ids.
    """
    for rid, p in zip(ids, prompts, strict=True):
        b.add(rid, p)
    loaded_at: dict[str, float] = {}
    scheduled: dict[str, tuple[int, list[int]]] = {}
    t0 = time.perf_counter()
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while len(scheduled) < len(ids) and time.monotonic() < deadline:
        res = b.step()
        for rid in res.finished_recving:
            loaded_at.setdefault(rid, res.results_at)
        for rid, (computed, blocks) in res.new_blocks.items():
            scheduled[rid] = (computed, blocks)
            if res.loaded_before_forward and computed > 0:
                loaded_at.setdefault(rid, res.loads_started_at)
        if res.failed_recving or res.invalid_block_ids:
            failed = sorted(res.failed_recving)
            problems.append(f"B's loads failed: requests {failed}, blocks {sorted(res.invalid_block_ids)}")
    load_s = (max(loaded_at.values()) - t0) if loaded_at else float("inf")
    b.run_until_idle(PHASE_TIMEOUT_S)
    return load_s, {rid: s for rid, s in scheduled.items() if rid in loaded_at}


def make_scenario() -> PoolVllmScenario:
    """Entry point of ``ascend_dist.scenarios`` (imports neither vLLM nor torch)."""
    return PoolVllmScenario()
