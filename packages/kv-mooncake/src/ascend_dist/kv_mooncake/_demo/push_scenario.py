"""The ``pd-layerwise`` scenario of ``ascend-dist demo`` and ``ascend-dist bench``.

Runs in: the CLI process (D instances) plus two child processes: the layer-wise P rank and, for the
bench's whole-prompt-pull comparison, the pull connector's P (`ascend_dist.kv_mooncake._demo.pd_peer`).

Demo: requests (one with a prefix hit on D, one prefilled in chunks) go through both sides'
scheduler and worker code; D announces to an in-process metaserver, the scenario plays the proxy,
P pushes each layer as its forward saves it, and D verifies every byte.

Bench (32 layers, split K/V, 64 KiB blocks): (1) the raw engine's ``batch_transfer_sync_write`` of
the same per-layer descriptors, back to back = *total transfer*; (2) a per-layer compute delay set
to transfer / layers, so compute ≈ transfer; (3) the layer-wise push with that delay, end to end
(proxy hand-off to D's ``finished_recving``); (4) the whole-prompt pull (MooncakeConnectorV1) of
the same model: the same compute, then D pulls. Figures: (3) vs ``max(compute, transfer)`` (target:
within 1.2x) and (3) vs (4) (target: faster). Best of ``repeat`` runs each.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ascend_dist.common.errors import ProtocolError
from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.kv_mooncake._demo.peer_process import PeerProcess, free_port_range
from ascend_dist.kv_mooncake._demo.push_peer import LwPeerProcess
from ascend_dist.kv_mooncake._demo.push_synthetic import CollectingMetaserver, LwInstance
from ascend_dist.kv_mooncake._demo.synthetic import Model, SyntheticInstance
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig

__all__ = ["LayerwiseScenario", "make_scenario"]

OVERLAP_TARGET = 1 / 1.2  # end to end within 1.2 x max(compute, transfer)
VS_PULL_TARGET = 1.0


class _Run:
    """One D instance and its P rank child, playing the proxy between them."""

    def __init__(self, p: PeerProcess, d: LwInstance, ms: CollectingMetaserver) -> None:
        self.p, self.d, self.ms = p, d, ms
        self.n = 0
        self.last_forward_s = 0.0

    def push(
        self, prompt: int, seed: int, *, compute_s: float = 0.0, computed: int = 0, chunks: int = 1, timed: bool = False
    ) -> tuple[str, float, set[int]]:
        """Announce on D, push from P, wait on D.

        With ``timed`` P writes the KV before its forward, so the forward costs only ``compute_s``
        per layer. Returns (rid, seconds from P's first layer to D's ``finished_recving``, errors).
        """
        rid = f"lw-{self.n}"
        self.n += 1
        self.d.announce(rid, prompt, computed_tokens=computed)
        params = self.ms.take(rid)
        self.p.send(
            {
                "cmd": "prefill",
                "name": "p",
                "params": params,
                "prompt_len": prompt,
                "seed": seed,
                "compute_s": compute_s,
                "chunks": chunks,
                "kv_in_forward": not timed,
            }
        )
        errors = self.d.wait_recv({rid}, timeout_s=120.0)
        finished = time.monotonic()  # CLOCK_MONOTONIC: comparable with P's on one host
        reply = self.p.read(120.0)
        if "error" in reply:
            raise ProtocolError(f"layer-wise P failed: {reply['error']}")
        self.last_forward_s = float(reply["elapsed"])  # P's forward alone (first layer to last save)
        return rid, finished - float(reply["start"]), errors


class LayerwiseScenario:
    """Layer-wise push P -> D over the real Mooncake engine, end to end."""

    name = "pd-layerwise"
    summary = "P pushes each layer into D's blocks as it is computed (MooncakeLayerwiseConnector), verified"
    modes = frozenset({"demo", "bench"})

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Start P, run the requests, verify, measure."""
        os.environ.setdefault("GLOG_minloglevel", "2")
        report = ScenarioReport(self.name, ctx.mode)
        blocks = 8 if ctx.quick else 16
        model: dict[str, Any] = {
            "layers": 32,
            "heads": 8,
            "head_dim": 128,
            "block_size": 32,
            "num_blocks": 4 * blocks + 4,
        }
        kv_port = free_port_range(1)
        extra = {
            "engine_id": "lw-P",
            "kv_port": kv_port,
            "host": "127.0.0.1",
            "prefill": {"tp_size": 1},
            "decode": {"tp_size": 1},
        }
        ctx.progress.step("starting the layer-wise P rank (child process)")
        with LwPeerProcess() as p:
            p.call({"cmd": "create", "name": "p", "config": extra, "model": model}, timeout_s=120.0)
            cfg = LayerwiseConfig.from_kv_transfer_config(
                engine_id="lw-D", kv_role="kv_consumer", kv_port=kv_port, extra=extra, model="synthetic", dtype="int16"
            )
            ms = CollectingMetaserver()
            d = LwInstance(cfg, Model(**model), metaserver=ms)
            try:
                run = _Run(p, d, ms)
                self._demo(ctx, report, run, model, blocks)
                if ctx.mode == "bench":
                    self._bench(ctx, report, run, model, blocks)
            finally:
                d.shutdown()
        return report

    def _demo(
        self, ctx: ScenarioContext, report: ScenarioReport, run: _Run, model: dict[str, Any], blocks: int
    ) -> None:
        bs = model["block_size"]
        cases = [
            ("plain", blocks * bs - 5, 0, 1),
            ("prefix hit on D", blocks * bs, 2 * bs, 1),
            ("chunked prefill (3 steps)", blocks * bs - 9, 0, 3),
        ]
        ctx.progress.step(f"{len(cases)} requests x 32 layers: announce on D, push per layer from P, verify")
        total, errors = 0, 0
        for i, (label, prompt, computed, chunks) in enumerate(cases):
            rid, _, errs = run.push(prompt, seed=i, computed=computed, chunks=chunks)
            errors += len(errs)
            checked = run.d.verify(rid, i, computed_tokens=computed) if not errs else 0
            total += checked
            report.check(f"{label}: every pushed byte equals P's", not errs and checked > 0, f"{checked:,} bytes")
            run.d.finish(rid)
            ctx.progress.advance(i + 1, len(cases))
        lent = run.p.call({"cmd": "idle", "name": "p"})["blocks_lent"]
        report.check("P freed every block and every layer's push finished", lent == 0, f"{lent} blocks lent")
        ctx.progress.step(f"verified {total / 2**20:.1f} MiB pushed layer by layer, {errors} load errors")

    def _bench(
        self, ctx: ScenarioContext, report: ScenarioReport, run: _Run, model: dict[str, Any], blocks: int
    ) -> None:
        prompt, layers = blocks * model["block_size"], model["layers"]
        nbytes = 2 * layers * blocks * model["block_size"] * model["heads"] * model["head_dim"] * 2
        ctx.progress.step(f"transfer alone: {nbytes / 2**20:.0f} MiB, raw engine writes vs the connector's push")
        raw, push0 = float("inf"), float("inf")
        for _ in range(max(1, ctx.repeat)):
            rid, elapsed, errs = run.push(prompt, seed=50, timed=True)
            push0 = min(push0, elapsed)
            report.check("transfer-only push verified", not errs and run.d.verify(rid, 50) > 0)
            params = self._params_of(run, rid)  # the raw writes land in the same (verified) D blocks
            raw = min(
                raw,
                float(
                    run.p.call(
                        {"cmd": "raw_push", "name": "p", "params": params, "prompt_len": prompt}, timeout_s=120.0
                    )["elapsed"]
                ),
            )
            run.d.finish(rid)
        compute_s = raw / layers
        ctx.progress.step(
            f"compute {compute_s * 1e3:.2f} ms per layer (~ transfer): layer-wise push vs whole-prompt pull"
        )
        lw, forward = float("inf"), float("inf")
        for _ in range(max(1, ctx.repeat)):
            rid, elapsed, errs = run.push(prompt, seed=60, compute_s=compute_s, timed=True)
            lw, forward = min(lw, elapsed), min(forward, run.last_forward_s)
            report.check("overlapped push verified", not errs and run.d.verify(rid, 60) > 0)
            run.d.finish(rid)
        compute = min(
            float(run.p.call({"cmd": "compute_only", "name": "p", "compute_s": compute_s})["elapsed"])
            for _ in range(max(1, ctx.repeat))
        )  # the sleeps as the loaded machine really runs them
        pull = self._pull(ctx, report, model, prompt, compute_s)
        bound = max(compute, raw)
        ctx.progress.step(
            f"layer-wise {lw * 1e3:.1f} ms | compute {compute * 1e3:.1f} ms (nominal {compute_s * layers * 1e3:.1f})"
            f" | transfer {raw * 1e3:.1f} ms | P's forward while pushing {forward * 1e3:.1f} ms"
            f" | whole-prompt pull {pull * 1e3:.1f} ms"
        )
        label = f"{layers} layers x {nbytes / 2**20:.0f} MiB"
        report.measurements += [
            Measurement(
                f"layer-wise push end to end, compute ~ transfer, {label}",
                lw * 1e3,
                "ms",
                bound * 1e3,
                "max(measured total compute, total raw-engine transfer), same run",
                higher_is_better=False,
                target_ratio=OVERLAP_TARGET,
            ),
            Measurement(
                f"layer-wise push vs whole-prompt pull (MooncakeConnectorV1), {label}",
                lw * 1e3,
                "ms",
                pull * 1e3,
                "compute, then D pulls the whole prompt, same run",
                higher_is_better=False,
                target_ratio=VS_PULL_TARGET,
            ),
            Measurement(
                f"transfer alone: connector push (no compute), {label}",
                push0 * 1e3,
                "ms",
                raw * 1e3,
                "raw batch_transfer_sync_write per layer, same descriptors",
                higher_is_better=False,
            ),
        ]

    @staticmethod
    def _params_of(run: _Run, rid: str) -> dict[str, Any]:
        """Re-announce-free params for the raw baseline: D's blocks of ``rid`` (still allocated)."""
        c = run.d.config
        return {
            "request_id": f"{rid}-raw",
            "remote_engine_id": c.engine_id,
            "remote_host": c.host,
            "remote_port": c.d_ports.dp_base(c.dp_rank),
            "remote_block_ids": run.d.blocks[rid],
        }

    @staticmethod
    def _pull(
        ctx: ScenarioContext, report: ScenarioReport, model: dict[str, Any], prompt: int, compute_s: float
    ) -> float:
        """The whole-prompt pull of the same model: P's per-layer compute, then D's pull, best of ``repeat``."""
        kv_port = free_port_range(1)
        extra = {
            "engine_id": "pull-P",
            "kv_port": kv_port,
            "host": "127.0.0.1",
            "prefill": {"tp_size": 1},
            "decode": {"tp_size": 1},
        }
        best = float("inf")
        with PeerProcess() as peer:
            p = peer.create("p", extra, model)
            cfg = PullConfig.from_kv_transfer_config(
                engine_id="pull-D",
                kv_role="kv_consumer",
                kv_port=kv_port,
                extra=extra,
                model="synthetic",
                dtype="int16",
            )
            d = SyntheticInstance(cfg, Model(**model))
            try:
                for i in range(max(1, ctx.repeat)):
                    rid = f"pull-{i}"
                    params = p.prefill(rid, prompt, seed=70)  # P's KV written (untimed, as for the push)
                    start = time.perf_counter()
                    for _ in range(model["layers"]):  # P's forward: the same per-layer compute
                        time.sleep(compute_s)
                    d.decode(rid, prompt, params)
                    errs = d.wait_recv({rid}, timeout_s=120.0)
                    best = min(best, time.perf_counter() - start)
                    report.check("whole-prompt pull verified", not errs and d.verify(rid, 70) > 0)
                    d.finish_decode(rid)
            finally:
                d.shutdown()
                p.drop()
        return best


def make_scenario() -> LayerwiseScenario:
    """Entry point of ``ascend_dist.scenarios``."""
    return LayerwiseScenario()
