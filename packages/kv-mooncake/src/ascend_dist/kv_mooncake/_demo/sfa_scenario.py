"""The ``pd-sfa`` scenario of ``ascend-dist demo`` and ``ascend-dist bench``.

Runs in: the CLI process (the D instance: host pool, indexer caches, read threads) plus one child
process (the P instance). D allocates each request and posts its contact info; the scenario's
proxy step hands it to P, which prefills in chunks and signals every layer; D reads each layer
from P's memory while P goes on. Every byte D holds is verified against the pattern P wrote.

The bench then repeats the run with a zero-compute prefill (P dispatches every layer at once) and
times it end to end, from P's first command to D reporting every request; the baseline replays
exactly the descriptor batches D's read threads issued, with the raw engine's
``batch_transfer_sync_read``, back to back in the same run.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ascend_dist.common.scenarios import Measurement, ScenarioContext, ScenarioReport
from ascend_dist.kv_mooncake._demo.peer_process import free_port_range
from ascend_dist.kv_mooncake._demo.sfa_peer_process import SfaP, SfaPeer
from ascend_dist.kv_mooncake._demo.sfa_synthetic import SfaDInstance, SfaModel
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.engine import MooncakeEngine, get_engine
from ascend_dist.kv_mooncake.pull.config import Role
from ascend_dist.kv_mooncake.sfa.config import SfaConfig

__all__ = ["SfaScenario", "make_scenario"]

_RAW = "raw batch_transfer_sync_read, same descriptor batches"


class SfaScenario:
    """SFA remote D2H over the real Mooncake engine, P and D in separate processes."""

    name = "pd-sfa"
    summary = "SfaRemoteD2HConnector: D reads each layer from P while P prefills, verified byte for byte"
    modes = frozenset({"demo", "bench"})

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Start P, run the requests, verify; in bench mode also time against the raw engine."""
        os.environ.setdefault("GLOG_minloglevel", "2")
        report = ScenarioReport(self.name, ctx.mode)
        requests = 6 if ctx.quick else 12
        blocks = 8 if ctx.quick else 16
        model = SfaModel(
            layers=4, block_size=64, num_blocks=requests * blocks + 8, main_dims=(256, 32), indexer_dims=(64,)
        )
        extra: dict[str, Any] = {
            "kv_port": free_port_range(2),
            "host": "127.0.0.1",
            "prefill": {"tp_size": 2},
            "decode": {"tp_size": 2},
            "transfer_backend": "mooncake",
            "read_timeout_s": 30.0,
        }
        ctx.progress.step("starting the P instance (child process, P_tp=2 -> D_tp=2)")
        with SfaPeer() as peer:
            p = peer.create_p("p", {**extra, "engine_id": "sfa-P"}, _model_dict(model))
            cfg = SfaConfig.from_kv_transfer_config(
                engine_id="sfa-D",
                kv_role=Role.CONSUMER.value,
                kv_port=extra["kv_port"],
                extra=extra,
                model="synthetic-sfa",
                dtype="int16",
            )
            engine = get_engine(cfg.host, cfg.protocol)
            d = SfaDInstance(cfg, model, engine)
            try:
                self._verified(ctx, report, (p, d), requests, blocks * model.block_size)
                if ctx.mode == "bench":
                    self._bench(ctx, report, (p, d, engine), requests, blocks * model.block_size)
            finally:
                d.shutdown()
                p.drop()
        return report

    @staticmethod
    def _batch(d: SfaDInstance, tag: str, n: int, prompt: int, *, fill: bool, chunk: int) -> list[dict[str, Any]]:
        return [
            {
                "rid": f"p-{tag}{i}",
                "prompt_len": prompt - i,
                "seed": i,
                "params": d.decode(f"{tag}{i}", prompt - i),
                "chunk": chunk,
                "fill": fill,
            }
            for i in range(n)
        ]

    def _verified(
        self, ctx: ScenarioContext, report: ScenarioReport, pair: tuple[SfaP, SfaDInstance], n: int, prompt: int
    ) -> None:
        p, d = pair
        ctx.progress.step(f"{n} requests of ~{prompt} tokens, chunked prefill on P, layer-wise reads by D, verify")
        items = self._batch(d, "v", n, prompt, fill=True, chunk=prompt // 2)
        start = time.perf_counter()
        p.prefill_batch(items, timeout_s=120.0)
        errors = d.wait_recv({it["rid"][2:] for it in items}, timeout_s=120.0)
        seconds = time.perf_counter() - start
        checked = 0
        for i, it in enumerate(items):
            checked += d.verify(it["rid"][2:], it["seed"])
            d.finish(it["rid"][2:])
            ctx.progress.advance(i + 1, n)
        drained = p.drain()
        report.check(
            "every byte D read equals P's", not errors, f"{n} requests, {checked / 2**20:.1f} MiB (pool + indexers)"
        )
        report.check("P's gates all open, no request failed", drained["failed"] == {}, str(drained["failed"])[:200])
        report.check("D reported every request", all(w.pending == 0 for w in d.workers))
        ctx.progress.step(
            f"results: {n} requests | {checked:,} bytes verified | {sum(w.reads for w in d.workers)} batched reads "
            f"| {seconds * 1e3:.0f} ms including P's compute"
        )

    def _bench(
        self,
        ctx: ScenarioContext,
        report: ScenarioReport,
        parts: tuple[SfaP, SfaDInstance, MooncakeEngine],
        n: int,
        prompt: int,
    ) -> None:
        ctx.progress.step("bench: zero-compute prefill, connector end to end vs the raw engine on the same batches")
        p, d, backend = parts
        best_conn = best_raw = float("inf")
        nbytes = pieces = 0
        trace: list[tuple[str, Descriptors]] = []
        for rep in range(max(1, ctx.repeat)):
            trace = []
            for w in d.workers:
                w.trace = trace
            items = self._batch(d, f"b{rep}-", n, prompt, fill=False, chunk=prompt)
            start = time.perf_counter()
            p.prefill_batch(items, timeout_s=120.0)
            errors = d.wait_recv({it["rid"][2:] for it in items}, timeout_s=120.0)
            best_conn = min(best_conn, time.perf_counter() - start)
            for w in d.workers:
                w.trace = None
            nbytes = sum(b.total_bytes for _, b in trace)
            pieces = sum(len(b) for _, b in trace)
            start = time.perf_counter()
            rcs = [backend.raw_read(session, batch) for session, batch in trace]
            best_raw = min(best_raw, time.perf_counter() - start)
            report.check(f"bench run {rep}: no load error, raw replay ok", not errors and not any(rcs))
            for it in items:
                d.finish(it["rid"][2:])
            p.drain()
            ctx.progress.advance(rep + 1, max(1, ctx.repeat))
        report.measurements.append(
            Measurement(
                f"read {nbytes / 2**20:.0f} MiB in {len(trace)} layer batches ({pieces} pieces), {n} requests",
                nbytes / best_conn / 1e9,
                "GB/s",
                nbytes / best_raw / 1e9,
                _RAW,
            )
        )


def _model_dict(model: SfaModel) -> dict[str, Any]:
    return {
        "layers": model.layers,
        "block_size": model.block_size,
        "num_blocks": model.num_blocks,
        "main_dims": list(model.main_dims),
        "indexer_dims": list(model.indexer_dims),
    }


def make_scenario() -> SfaScenario:
    """Entry point of ``ascend_dist.scenarios``."""
    return SfaScenario()
