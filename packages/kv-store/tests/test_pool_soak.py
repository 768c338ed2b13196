"""Bounded soak of the pool connector through vLLM 0.33's real ``Scheduler`` over a real ``mooncake_master``.

Per mode (synchronous loads, ``load_async``, ``use_layerwise``): three instances (a ``Scheduler``
and a factory-built ``AscendStoreConnector`` worker each; prefix caching on for one, off for two)
share one pool and run a seeded random mix of short prompts drawn from a few shared prefixes, one
engine step each in turn, in vLLM's runner order (`pool_soak_support.SoakInstance`). Faults: a store
outage (master SIGKILLed, restarted), a hang (master SIGSTOPped, SIGCONT from a child process a few
seconds later), evictions between the lookup and the load (a store client removes a chunk the step
is about to load), preemptions (a small KV cache) and aborts (``finish_requests`` ABORTED).

Afterwards: every request finished; every block the connector loaded held exactly its request's
deterministic KV (checked after each step; a sentinel or another prefix's bytes fail); every block
back in vLLM's free pool and no request id left in either connector's objects; no thread or socket
left after shutdown; a prefix pooled after the master restart is hit by another instance.

``ASCEND_DIST_SOAK_REQUESTS`` (default 1000), ``ASCEND_DIST_SOAK_SEED`` (default 20261203) and
``ASCEND_DIST_SOAK_SECONDS`` (submission time bound per mode, default 90; each fault fires at its
share of the requests or of this time, whichever comes first) tune a run; the per-mode
counts and times are printed (``-s``), and a failure names the seed, mode and step.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.soak, pytest.mark.mooncake, pytest.mark.timeout(400)]
vllm = pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from pool_soak_support import (  # noqa: E402
    BLOCK,
    LAYERS,
    Counters,
    Failure,
    Loaded,
    SoakInstance,
    classify_copy,
    expected_values,
    make_config,
    open_sockets,
    request_id_refs,
    wait_threads_gone,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dist.kv_store.keys.keys import chunk_hash_hex  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402
from ascend_dist.testing.ports import free_port  # noqa: E402

MODES: dict[str, dict[str, Any]] = {"sync": {}, "async": {"load_async": True}, "layerwise": {"use_layerwise": True}}
REQUESTS = int(os.environ.get("ASCEND_DIST_SOAK_REQUESTS", "1000"))
SEED = int(os.environ.get("ASCEND_DIST_SOAK_SEED", "20261203"))
SUBMIT_S = float(os.environ.get("ASCEND_DIST_SOAK_SECONDS", "90"))
NUM_BLOCKS = 24  # 23 usable: 8 requests of up to 6 blocks plus their decode blocks do not fit, so vLLM preempts
PREFIX_CACHING = (True, False, False)  # per instance: prefix caching off lets one step share a chunk in two blocks
PER_INSTANCE = 8  # unfinished requests an instance is kept at while submitting
DOWN_S = 1.5  # store outage length
HANG_S = 3.0  # store hang length
STALL_SLACK_S = 10.0  # a worker step may outlast the hang by this much (a loaded 2-core machine)
RESUME_S = 20.0  # a prefix saved after the restart must be hit within this
DRAIN_S = 60.0


@dataclass
class Probe:
    """Hits resume after the outage: instance 0 saves a fresh prefix, instance 1 must load it."""

    restarted_at: float = 0.0
    attempt: int = 0
    saver: str | None = None
    loader: str | None = None
    prompt: list[int] = field(default_factory=list)
    hit_after_s: float | None = None
    done: bool = False


class Soak:
    """One mode's run: instances, the store faults and the request mix, stepped until drained."""

    def __init__(self, mode: str, model_dir: Path, master: Any, seed: int) -> None:
        self.mode = mode
        self.master = master
        self.seed = seed
        self.rng = random.Random(seed)
        self.counters = Counters()
        self.failures: list[Failure] = []
        self.step_no = 0
        self.submitted = 0
        self.probe = Probe()
        self.phase = "before-outage"
        self.down_at = 0.0
        self.resumer: subprocess.Popen[bytes] | None = None
        self.hung = False
        self.walker_control = 0
        self.started_at = time.monotonic()
        self.ids: set[str] = set()
        self.prefixes = [[self.rng.randint(1, 999) for _ in range(5 * BLOCK)] for _ in range(4)]
        self.insts = [
            SoakInstance(
                f"i{i}",
                make_config(
                    model_dir, master.address, free_port(), prefix_caching=pc, num_blocks=NUM_BLOCKS, **MODES[mode]
                ),
                NUM_BLOCKS,
            )
            for i, pc in enumerate(PREFIX_CACHING)
        ]
        for inst in self.insts:
            inst.inspect = self._pool_copy
        self.admin = store_client(master.address)

    # ---- the request mix ----

    def _prompt(self) -> list[int]:
        rng = self.rng
        if rng.random() < 0.75:  # a shared prefix, cut at a chunk, then unique chunks
            shared = rng.randint(1, 4)
            prompt = self.prefixes[rng.randrange(len(self.prefixes))][: shared * BLOCK]
            unique = rng.randint(max(0, 2 - shared), min(2, 6 - shared))
        else:
            prompt, unique = [], rng.randint(2, 6)
        prompt = prompt + [rng.randint(1, 999) for _ in range(unique * BLOCK + rng.randint(0, BLOCK - 1))]
        return prompt

    def _submit(self, inst: SoakInstance, req_id: str, prompt: list[int], max_tokens: int) -> None:
        inst.add(req_id, prompt, max_tokens)
        self.ids.add(req_id)

    def _reached(self, fraction: float) -> bool:
        """A fault's mark: ``fraction`` of the requests submitted, or of the submission time gone.

        The time half makes every fault fire on a machine too slow to submit them all (the run is
        time-bound there), so the controls below hold on a loaded CI host too.
        """
        elapsed = time.monotonic() - self.started_at
        return self.submitted >= REQUESTS * fraction or elapsed >= SUBMIT_S * fraction

    def _cap(self) -> int:
        """Submissions stop at the outage's mark until it fired, so it meets live requests, and at the
        hang's mark until the store is back, so the hang (at the first step with loads past its mark,
        `_on_scheduled`) meets 40 % of the requests still to come.
        """
        return {"before-outage": REQUESTS // 4, "down": (REQUESTS * 3) // 5}.get(self.phase, REQUESTS)

    def _mix(self, inst: SoakInstance, submitting: bool) -> None:
        while submitting and self.submitted < self._cap() and len(inst.unfinished()) < PER_INSTANCE:
            if self.rng.random() < 0.3:
                break
            self._submit(inst, f"{self.mode}-{self.submitted}", self._prompt(), self.rng.randint(1, 24))
            self.submitted += 1
        victims = [r for r in inst.unfinished() if not r.startswith("probe")]
        if victims and self.rng.random() < 0.05:
            victim = self.rng.choice(sorted(victims))
            inst.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            inst.note(victim, self.step_no, "aborted")
            self.counters.aborts += 1

    def _on_scheduled(self, inst: SoakInstance, out: Any) -> None:
        """After the lookup answered (``schedule()``), before the worker loads: evict a chunk, or hang the store."""
        loads = [
            r
            for r in out.kv_connector_metadata.step.requests
            if r.load_spec is not None and r.load_spec.can_load and not r.req_id.startswith("probe")
        ]
        if not loads or self.phase == "down":
            return
        if not self.hung and self._reached(3 / 5):
            self._hang()  # this step's loads (and saves) meet the hung store
        if self.rng.random() < 0.15:
            self._evict(self.rng.choice(loads))

    def _evict(self, req: Any) -> None:
        first = req.load_spec.vllm_cached_tokens // BLOCK
        last = -(-req.load_spec.pool_cached_tokens // BLOCK)
        if last <= first or last > len(req.block_hashes):
            return
        chunk = req.block_hashes[self.rng.randrange(first, last)]
        removed = self.admin.remove_by_regex(f".*{re.escape(chunk_hash_hex(chunk))}.*", True)
        if removed > 0:
            self.counters.evictions += 1

    def _hang(self) -> None:
        pid = self.master._proc.pid
        os.kill(pid, signal.SIGSTOP)
        # resumed by a child process, so a step blocked on the hung store cannot delay the SIGCONT
        self.resumer = subprocess.Popen(["sh", "-c", f"sleep {HANG_S}; kill -CONT {pid}"])
        self.hung = True

    def _pool_copy(self, inst: SoakInstance, claim: Loaded, hashes: list[int]) -> str:
        """What the pool holds now under the chunk a wrong block loaded: tells a bad load from a bad save."""
        chunk = inst.chunk_of.get((claim.req_id, claim.block))
        if chunk is None:
            return "its chunk is unknown"
        try:
            meta = inst.scheduler.connector._spec.key_metadata()[0]  # type: ignore[union-attr]
            # layer-wise: every layer's object, in `expected_values` order (a wrong layer 1 alone shows)
            keys = (
                [meta.layer_key(chunk, layer) for layer in range(len(LAYERS))]
                if self.mode == "layerwise"
                else [meta.pool_key(chunk)]
            )
            parts = [bytes(self.admin.get(key)) for key in keys]
        except Exception as exc:  # diagnostics only: never hide the failure being reported
            return f"pool copy unreadable ({exc!r})"
        if not all(parts):
            return "the pool no longer holds its chunk" + (" (some layers)" if any(parts) else "")
        got = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.float16)
        verdict = classify_copy(got, expected_values(hashes, range(len(LAYERS))) if claim.slots == BLOCK else None)
        for other in self.insts:
            if chunk in other.saved_by and "right" not in verdict:
                step, req_id, block = other.saved_by[chunk]
                history = " | ".join(other.history.get(req_id, []))
                verdict += f"; last saved by {other.name} {req_id} from block {block} at step {step}: {history}"
        return verdict

    # ---- store faults ----

    def _faults(self) -> None:
        now = time.monotonic()
        if self.phase == "before-outage" and self._reached(1 / 4):
            self.master.kill()
            self.phase, self.down_at = "down", now
            # control for the leak walk: it must find the requests in flight now
            self.walker_control = sum(
                len(request_id_refs(inst.scheduler.connector, set(inst.unfinished()))) for inst in self.insts
            )
        elif self.phase == "down" and now - self.down_at >= DOWN_S:
            self.master.start()
            self.phase = "restarted"
            self.probe.restarted_at = time.monotonic()

    def _probe(self) -> None:
        p = self.probe
        if self.phase != "restarted" or p.done:
            return
        saver, loader = self.insts[0], self.insts[1]
        if p.loader is not None and p.loader not in loader.scheduler.requests:
            if loader.loaded_by_req.get(p.loader, 0) > 0:
                p.hit_after_s, p.done = time.monotonic() - p.restarted_at, True
                return
            p.saver = p.loader = None  # missed: the store may not have been back yet; try a new prefix
        if p.saver is None:
            if time.monotonic() - p.restarted_at > RESUME_S:
                p.done = True  # failed: no hit within RESUME_S
                return
            p.attempt += 1
            p.prompt = [self.rng.randint(1, 999) for _ in range(4 * BLOCK + 5)]
            p.saver = f"probe-{self.mode}-save-{p.attempt}"
            self._submit(saver, p.saver, p.prompt, 1)
        elif p.loader is None and p.saver not in saver.scheduler.requests:  # finished and its saves settled
            p.loader = f"probe-{self.mode}-load-{p.attempt}"
            self._submit(loader, p.loader, p.prompt, 1)

    # ---- the run ----

    def run(self) -> float:
        start = self.started_at = time.monotonic()
        drain_from: float | None = None
        while True:
            submitting = time.monotonic() - start < SUBMIT_S
            if not submitting and self.submitted < REQUESTS and not self.counters.notes:
                self.counters.notes.append(f"time bound: {self.submitted} of {REQUESTS} requests submitted")
            for inst in self.insts:
                self._mix(inst, submitting)
                inst.step(self.step_no, self.counters, self.failures, on_scheduled=self._on_scheduled)
                self.step_no += 1
            self._faults()
            self._probe()
            # held (finished, saving) requests, and finished ids not yet sent to the workers, need steps too
            busy = any(inst.live() or inst.scheduler.has_requests() for inst in self.insts)
            if not busy:
                time.sleep(0.01)  # waiting for the probe's store: no idle spin
            if (self.submitted >= REQUESTS or not submitting) and self.probe.done and not busy:
                return time.monotonic() - start
            if self.submitted >= REQUESTS or not submitting:
                drain_from = drain_from or time.monotonic()
                if time.monotonic() - drain_from > DRAIN_S:
                    left = {i.name: i.live() for i in self.insts}
                    raise AssertionError(f"not drained within {DRAIN_S}s: {left}, probe {self.probe}")

    def histories(self) -> str:
        """The last engine step's connector output and its requests' histories (for a failure report)."""
        lines = []
        for inst in self.insts:
            kv = inst.last_kv_out
            if kv is None:
                continue
            lines.append(f"{inst.name} last output {kv}")
            for req_id in sorted((kv.finished_sending or set()) | (kv.finished_recving or set())):
                lines.append(f"  {req_id}: " + " | ".join(inst.history.get(req_id, [])))
        return "\n".join(lines)

    def close(self) -> None:
        if self.resumer is not None:
            self.resumer.wait(timeout=HANG_S + 10)
        for inst in self.insts:
            inst.close()
        self.admin.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return vb.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("mode", list(MODES))
def test_pool_soak(mode: str, model_dir: Path, fresh_master: Any) -> None:
    seed = SEED + list(MODES).index(mode)
    # Mooncake keeps one process-wide unix socket from its first client on (checked: it does not
    # grow per client): a throwaway client makes it exist before the baseline, so it is no leak.
    store_client(fresh_master.address).close()
    threads_before = set(threading.enumerate())
    sockets_before = open_sockets()
    _soak(mode, model_dir, fresh_master, seed=seed, threads=threads_before, sockets=sockets_before)


def store_client(address: str) -> Any:
    """A Mooncake store client contributing no memory (evictions between lookup and load)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", address) == 0
    return client


def _soak(
    mode: str,
    model_dir: Path,
    master: Any,
    *,
    seed: int,
    threads: set[threading.Thread],
    sockets: dict[str, str],
) -> None:
    """One mode's soak and every check after it (``threads`` and ``sockets``: the baseline)."""
    soak = Soak(mode, model_dir, master, seed)
    where = f"seed={seed} (ASCEND_DIST_SOAK_SEED={SEED}) mode={mode}"
    closed = False
    try:
        # controls: the instances hold threads and sockets, so their absence afterwards means something
        assert [t for t in threading.enumerate() if t not in threads], "the connectors started no thread"
        assert set(open_sockets()) - set(sockets), "the connectors opened no socket"
        try:
            elapsed = soak.run()
        except Exception as exc:
            raise AssertionError(f"{where} step={soak.step_no}: {exc!r}; {soak.histories()}") from exc
        c = soak.counters
        c.finished = sum(1 for inst in soak.insts for r in inst.requests.values() if r.is_finished())
        print(
            f"\nsoak {where}: {soak.submitted} requests (+{soak.probe.attempt * 2} probes) in {elapsed:.1f}s, "
            f"{c.steps} steps; verified {c.verified_blocks} loaded blocks, {c.failed_load_blocks} failed blocks, "
            f"{c.failed_recving} failed async loads; {c.preemptions} preemptions, {c.aborts} aborts, "
            f"{c.evictions} evictions; hit {soak.probe.hit_after_s}s after restart; "
            f"max schedule {c.max_schedule_s:.1f}s, max worker step {c.max_worker_s:.1f}s; {c.notes}"
        )
        problems = _after_drain(soak)
        soak.close()
        closed = True
        left = wait_threads_gone(threads)
        if left:
            problems.append(f"threads left after shutdown: {left}")
        left_sockets = {k: v for k, v in open_sockets().items() if k not in sockets}
        if left_sockets:
            problems.append(f"sockets left after shutdown (the master: port {master.port:04X}): {left_sockets}")
        # controls: a soak whose faults never fired or that loaded nothing proves nothing
        if not (c.verified_blocks >= 100 and c.preemptions and c.aborts and c.evictions):
            problems.append(f"control: too little happened: {c}")
        if not (soak.hung and soak.phase == "restarted"):
            problems.append("control: the store faults did not all fire")
        if c.max_worker_s > HANG_S + STALL_SLACK_S:  # every wait has a deadline: no step outlasts the hang by much
            problems.append(f"a worker step took {c.max_worker_s:.1f}s (the store hung {HANG_S}s)")
        if not soak.walker_control:
            problems.append("control: the leak walk found no request in flight")
        if not c.failed_load_blocks + c.failed_recving:
            problems.append("control: evictions never surfaced as failed loads")
        assert not problems, f"{where}: " + "\n".join(problems)
    finally:
        if not closed:
            soak.close()


def _after_drain(soak: Soak) -> list[str]:
    """Every check on the drained instances (all of them, so one run reports every problem)."""
    problems: list[str] = []
    if soak.failures:
        kinds: dict[str, list[Failure]] = {}
        for f in soak.failures:
            kinds.setdefault(f.kind, []).append(f)
        shown = "\n".join(f"  {len(fs)} x {kind}; first: {fs[0]}" for kind, fs in kinds.items())
        problems.append(f"{len(soak.failures)} wrong loaded block(s), by kind:\n{shown}")
    unfinished = [r for i in soak.insts for r, req in i.requests.items() if not req.is_finished()]
    if unfinished:
        problems.append(f"not finished: {unfinished[:10]}")
    if soak.probe.hit_after_s is None:
        problems.append(f"no pool hit within {RESUME_S}s of the restart")
    for inst in soak.insts:
        free = inst.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        if free != NUM_BLOCKS - 1:
            problems.append(f"{inst.name} holds {NUM_BLOCKS - 1 - free} block(s) after the drain")
        for role, connector in (("scheduler", inst.scheduler.connector), ("worker", inst.worker)):
            refs = request_id_refs(connector, soak.ids)
            if refs:
                problems.append(f"{inst.name} {role} connector still names finished requests: {refs[:5]}")
    return problems
