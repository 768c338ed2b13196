"""The pool soak's parts: deterministic KV, one instance driven in vLLM 0.33's runner order, leak probes.

Imported by name by ``test_pool_soak.py`` (conftest puts this folder on ``sys.path``). vLLM and torch
are imported by the test module first (it skips without vLLM).

Deterministic KV: the K/V of the token at position ``p`` is a function of the token ids ``0..p`` only
(a rolling hash of the prefix spread over every element as small integers, exact in fp16), so two
requests sharing a prefix have identical blocks there and a block holding any other prefix's bytes
differs. Fresh blocks are filled with `SENTINEL`, outside that function's range, so a load that
never wrote a block cannot pass.

"Loaded by the connector" is read off vLLM itself: a block vLLM counts as computed when it schedules
a new or resumed request, that was freshly allocated (not a local prefix-cache hit) and that no
forward pass wrote, can only hold what the connector put there.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from ascend_dist.testing import vllm_builders as vb

MODULE = "ascend_dist.kv_store.vllm_connector"
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
BLOCK = vb.BLOCK  # 16 tokens, also the pool's chunk
HEADS, DIM = 2, 16  # the tiny Llama's KV heads and head size
SENTINEL = 3000.0  # exact in fp16, outside the deterministic values' range [-1019, 1019]
_PRIME, _MOD = 1_000_003, (1 << 61) - 1
_ELEMS = torch.arange(1, HEADS * DIM + 1, dtype=torch.int64)


def prefix_hashes(tokens: Iterable[int], start: list[int] | None = None) -> list[int]:
    """Rolling hash of every prefix of ``tokens`` (``start``: the hashes already known, extended)."""
    out = list(start or [])
    h = out[-1] if out else 0
    for t in list(tokens)[len(out) :]:
        h = (h * _PRIME + t + 1) % _MOD
        out.append(h)
    return out


def slot_values(hashes: list[int], layer: int, kv: int) -> torch.Tensor:
    """``[len(hashes), HEADS, DIM]`` fp16: the KV of the positions whose prefix hashes are given."""
    h = torch.tensor(hashes, dtype=torch.int64)
    a = (h % 1_000_003).unsqueeze(1)
    b = ((h >> 21) % 999_983).unsqueeze(1)
    v = (a * _ELEMS + b * (2 * layer + kv + 1) + 31 * layer + 17 * kv) % 2039 - 1019
    return v.to(torch.float16).reshape(len(hashes), HEADS, DIM)


def block_digest(caches: dict[str, tuple[torch.Tensor, torch.Tensor]], block: int, n: int) -> str:
    """Digest of the first ``n`` slots of ``block`` over every layer, K and V."""
    md = hashlib.blake2b(digest_size=12)
    for k, v in caches.values():
        md.update(k[block, :n].numpy().tobytes())
        md.update(v[block, :n].numpy().tobytes())
    return md.hexdigest()


def expected_values(hashes: list[int], layers: Iterable[int]) -> torch.Tensor:
    """Every value of slots holding these prefix hashes' KV in ``layers`` (K and V), flat."""
    return torch.cat([slot_values(hashes, layer, kv).flatten() for layer in layers for kv in (0, 1)])


def classify_copy(got: torch.Tensor, want: torch.Tensor | None) -> str:
    """What the pool's copy of a wrongly loaded chunk is (``want``: its right values, None for a partial block)."""
    if (got == SENTINEL).all():
        return "the pool's copy is the sentinel too (a save read a block before it was written or after it was zeroed)"
    if want is None:
        return f"the pool holds {got.numel()} values (partial block, not compared)"
    if got.numel() == want.numel() and torch.equal(got.sort().values, want.sort().values):
        return "the pool's copy is right (the load did not write this block)"
    return "the pool's copy is another prefix's bytes"


def expected_digest(hashes: list[int]) -> str:
    """`block_digest` of slots holding exactly the KV of these prefix hashes."""
    md = hashlib.blake2b(digest_size=12)
    for layer in range(len(LAYERS)):
        for kv in (0, 1):
            md.update(slot_values(hashes, layer, kv).numpy().tobytes())
    return md.hexdigest()


@dataclass(frozen=True)
class Failure:
    """One wrong loaded block: where and what it held."""

    step: int
    instance: str
    req_id: str
    block: int
    slots: int
    what: str
    kind: str = ""  # what held, whether its step loaded the chunk twice, what the pool holds (grouping)


@dataclass
class Loaded:
    """A block vLLM counts as computed that only the connector can have written."""

    req_id: str
    block: int
    first_token: int
    slots: int


@dataclass
class Counters:
    """What happened in one mode (printed, and controls: a soak that loads nothing proves nothing)."""

    steps: int = 0
    verified_blocks: int = 0
    failed_load_blocks: int = 0
    failed_recving: int = 0
    preemptions: int = 0
    aborts: int = 0
    evictions: int = 0
    finished: int = 0
    max_schedule_s: float = 0.0
    max_worker_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def make_config(model_dir: Path, master: str, port: int, *, prefix_caching: bool, num_blocks: int, **extra: Any) -> Any:
    """A CPU ``VllmConfig`` of the tiny Llama with ``AscendStoreConnector`` on ``master``."""
    store = {
        "master_server_address": master,
        "protocol": "tcp",
        "global_segment_size": "32MB",
        "local_buffer_size": "8MB",
    }
    ktc = KVTransferConfig(
        kv_connector="AscendStoreConnector",
        kv_role="kv_both",
        kv_connector_module_path=MODULE,
        kv_connector_extra_config={"backend": "mooncake", "store_config": store, "lookup_rpc_port": port, **extra},
        kv_load_failure_policy="recompute",  # a failed load is recomputed, as the soak's evictions expect
    )
    return vb.cpu_vllm_config(model_dir, ktc, num_blocks=num_blocks, enable_prefix_caching=prefix_caching)


class SoakInstance:
    """A vLLM ``Scheduler`` and a factory-built worker connector over split (K, V) CPU caches.

    `step` is one engine step in the order of vLLM 0.33's scheduler and model runner (as
    ``test_runner_order_loads_first_instances_bytes_over_split_kv`` drives it), with the forward
    writing each scheduled token's deterministic KV and every connector-loaded block checked after.
    """

    def __init__(self, name: str, config: Any, num_blocks: int) -> None:
        """Build both roles through vLLM (the scheduler creates its own connector) and fill every block."""
        self.name = name
        self.num_blocks = num_blocks
        self.kcc = vb.kv_cache_config([(LAYERS, vb.attention_spec(HEADS, DIM))], num_blocks=num_blocks)
        self.hasher = vb.block_hasher(config, self.kcc)
        self.worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, self.kcc)
        dims = (num_blocks, BLOCK, HEADS, DIM)
        self.caches = {
            n: (torch.full(dims, SENTINEL, dtype=torch.float16), torch.full(dims, SENTINEL, dtype=torch.float16))
            for n in LAYERS
        }
        self.worker.register_kv_caches(self.caches)  # type: ignore[arg-type]
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=self.kcc,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=False,
        )
        self.fresh: set[int] = set(range(num_blocks))  # blocks holding only the sentinel since allocation
        self.hashes: dict[str, list[int]] = {}
        self.requests: dict[str, Request] = {}
        self.loaded_by_req: dict[str, int] = {}  # connector-loaded blocks per request (hits)
        self.history: dict[str, list[str]] = {}  # per request: what happened at which step (failure reports)
        self._step_chunks: dict[bytes, list[tuple[str, int]]] = {}
        self.last_kv_out: Any = None
        self.saved_by: dict[bytes, tuple[int, str, int]] = {}  # chunk hash -> (step, request, block) of its last save
        self.chunk_of: dict[tuple[str, int], bytes] = {}  # (request, block) -> the chunk hash its load fetched
        self.inspect: Callable[[SoakInstance, Loaded, list[int]], str] | None = None  # the pool's copy (diagnostics)

    def note(self, req_id: str, step_no: int, what: str) -> None:
        """Remember one event of ``req_id`` (the last 20 are kept for a failure report)."""
        events = self.history.setdefault(req_id, [])
        events.append(f"{step_no}:{what}")
        del events[:-20]

    # ---- requests ----

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> Request:
        """Submit a request as the engine does (hashed with this instance's block hasher)."""
        req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, block_hasher=self.hasher)
        self.requests[req_id] = req
        self.scheduler.add_request(req)
        return req

    def live(self) -> list[str]:
        """Requests vLLM still holds (waiting, running, or finished with blocks held for saves)."""
        return list(self.scheduler.requests)

    def unfinished(self) -> list[str]:
        """Requests not finished yet (abortable)."""
        return [r for r, req in self.scheduler.requests.items() if not req.is_finished()]

    def _hashes(self, req_id: str, upto: int) -> list[int]:
        req = self.requests[req_id]
        known = self.hashes.get(req_id, [])
        if len(known) < upto:
            known = prefix_hashes(req.all_token_ids[:upto], known)
            self.hashes[req_id] = known
        return known[:upto]

    # ---- one engine step ----

    def _held(self) -> dict[str, set[int]]:
        manager = self.scheduler.kv_cache_manager
        return {r: set(manager.get_block_ids(r)[0]) for r in self.scheduler.requests}

    def _fresh_blocks(self, before: dict[str, set[int]], pre_hash: list[Any], step_no: int) -> list[int]:
        """Every block a request got this step that is not a local prefix-cache hit (the runner zeroes them).

        Only planned here, right after ``schedule()``: the sentinel goes in later (`_zero`), where vLLM's
        runner zeroes new blocks, after ``handle_preemptions``.
        """
        pool = self.scheduler.kv_cache_manager.block_pool.blocks
        after = self._held()
        # still held by a request that held it before: live content shared through a prefix-cache hit
        # (an async load cached this step is hit by another request before its hash existed pre-step)
        kept = {b for r, ids in after.items() for b in ids & before.get(r, set())}
        fill: list[int] = []
        for r, ids in after.items():
            new = ids - before.get(r, set()) - kept
            mine = [b for b in new if pre_hash[b] is None or pool[b].block_hash != pre_hash[b]]
            if mine:
                self.note(r, step_no, f"fresh {sorted(mine)}")
            fill += mine
        self.fresh |= set(fill)
        return fill

    def _zero(self, fill: list[int]) -> None:
        """The sentinel into ``fill``: what the runner's zeroing of new blocks stands for."""
        if fill:
            for k, v in self.caches.values():
                k[fill] = SENTINEL
                v[fill] = SENTINEL

    def _computed_now(self, out: Any) -> list[tuple[str, int]]:
        """``(req_id, num_computed_tokens)`` of requests vLLM schedules as new or resumed this step."""
        pairs = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        pairs += [
            (r, cached.num_computed_tokens[i]) for i, r in enumerate(cached.req_ids) if r in cached.resumed_req_ids
        ]
        return pairs

    @staticmethod
    def _chunk_loads(out: Any) -> dict[bytes, list[tuple[str, int]]]:
        """Chunk hash -> ``(req_id, block)`` of every load the step's metadata asks for (diagnostics)."""
        by_chunk: dict[bytes, list[tuple[str, int]]] = {}
        for r in out.kv_connector_metadata.step.requests:
            if r.load_spec is None or not r.load_spec.can_load:
                continue
            for j in range(r.load_spec.vllm_cached_tokens // BLOCK, -(-r.load_spec.pool_cached_tokens // BLOCK)):
                if j < len(r.block_hashes) and j < len(r.block_ids[0]):
                    by_chunk.setdefault(r.block_hashes[j], []).append((r.req_id, r.block_ids[0][j]))
        return by_chunk

    def _claimed_loads(self, out: Any) -> list[Loaded]:
        manager = self.scheduler.kv_cache_manager
        claims: list[Loaded] = []
        for req_id, computed in self._computed_now(out):
            ids = manager.get_block_ids(req_id)[0]
            for j in range(-(-computed // BLOCK)):
                if ids[j] in self.fresh:
                    claims.append(Loaded(req_id, ids[j], j * BLOCK, min(BLOCK, computed - j * BLOCK)))
                    self.fresh.discard(ids[j])
        return claims

    def _forward(self, out: Any) -> None:
        """Each layer: wait for its load, write the scheduled tokens' deterministic KV, queue its save."""
        manager = self.scheduler.kv_cache_manager
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update({r: cached.num_computed_tokens[i] for i, r in enumerate(cached.req_ids)})
        blocks: list[int] = []
        offsets: list[int] = []
        hashes: list[int] = []
        for req_id, n in out.num_scheduled_tokens.items():
            start = starts[req_id]
            ids = manager.get_block_ids(req_id)[0]
            hashes += self._hashes(req_id, start + n)[start:]
            for pos in range(start, start + n):
                blocks.append(ids[pos // BLOCK])
                offsets.append(pos % BLOCK)
        self.fresh -= set(blocks)
        for layer, name in enumerate(LAYERS):
            self.worker.wait_for_layer_load(name)
            k, v = self.caches[name]
            if blocks:
                k[blocks, offsets] = slot_values(hashes, layer, 0).reshape(len(hashes), HEADS, DIM)
                v[blocks, offsets] = slot_values(hashes, layer, 1).reshape(len(hashes), HEADS, DIM)
            self.worker.save_kv_layer(name, k, None)  # type: ignore[arg-type]

    def _sampled(self, out: Any) -> tuple[list[str], list[list[int]]]:
        """One token for every request whose scheduled tokens reach its end, none mid-prefill (as the runner)."""
        ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in ids:
            req = self.scheduler.requests[req_id]
            done = req.num_computed_tokens >= req.num_tokens  # vLLM advanced it in schedule()
            sampled.append(
                [50 + (len(req.all_token_ids) * 7919 + zlib.crc32(req_id.encode()) % 97) % 900] if done else []
            )
        return ids, sampled

    def _note_scheduled(self, out: Any, claims: list[Loaded], step_no: int) -> None:
        self._step_chunks = self._chunk_loads(out)
        for chunk, chunk_loads in self._step_chunks.items():
            for req_id, block in chunk_loads:
                self.chunk_of[req_id, block] = chunk
                peers = [x for x in chunk_loads if x[0] != req_id]
                self.note(req_id, step_no, f"load->{block}" + (f" shared with {peers}" if peers else ""))
        for claim in claims:
            self.note(claim.req_id, step_no, f"counted {claim.block}[:{claim.slots}]")
        for r in out.kv_connector_metadata.step.requests:
            if not r.can_save:
                continue
            for j in range(r.save_start_token // BLOCK, min(r.save_end_token // BLOCK, len(r.block_hashes))):
                self.saved_by[r.block_hashes[j]] = (step_no, r.req_id, r.block_ids[0][j])
                self.note(r.req_id, step_no, f"save<-{r.block_ids[0][j]}")
        for req_id in out.preempted_req_ids or ():
            self.note(req_id, step_no, "preempted")

    def _run_worker(self, out: Any, fill: list[int]) -> KVConnectorOutput:
        """vLLM 0.33's ``execute_model`` up to the step's connector output.

        ``handle_preemptions`` first, then the new blocks are zeroed (``_update_states``: vLLM zeroes
        ``new_block_ids_to_zero`` for Mamba and mixed-precision caches, and copies
        ``kv_cache_block_copies``, before the metadata is bound), then ``_get_kv_connector_output``
        around the forward.
        """
        connector = self.worker
        connector.handle_preemptions(out.kv_connector_metadata)
        self._zero(fill)
        connector.bind_connector_metadata(out.kv_connector_metadata)
        sync = bool(out.has_sync_kv_loads)
        if sync:
            connector.start_load_kv(None)  # type: ignore[arg-type]
        if out.total_num_scheduled_tokens:
            self._forward(out)
        if not sync:
            connector.start_load_kv(None)  # type: ignore[arg-type]
        connector.wait_for_save()
        results = connector.get_transfer_results(out.finished_req_ids)
        invalid = set(connector.get_block_ids_with_load_errors())
        connector.clear_connector_metadata()
        return KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=invalid,
        )

    def _note_output(self, kv_out: KVConnectorOutput, step_no: int) -> None:
        for req_id in kv_out.finished_recving or ():
            self.note(req_id, step_no, "recv done")
        invalid = kv_out.invalid_block_ids
        for req_id in self.scheduler.requests if invalid else ():
            bad = invalid & set(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
            if bad:
                self.note(req_id, step_no, f"invalid {sorted(bad)}")

    def step(self, step_no: int, counters: Counters, failures: list[Failure], on_scheduled: Any = None) -> Any:
        """One engine step; ``on_scheduled(self, out)`` runs between ``schedule()`` and the worker (faults)."""
        before = self._held()
        pre_hash = [b.block_hash for b in self.scheduler.kv_cache_manager.block_pool.blocks]
        t0 = time.monotonic()
        out = self.scheduler.schedule()
        counters.max_schedule_s = max(counters.max_schedule_s, time.monotonic() - t0)
        counters.preemptions += len(out.preempted_req_ids or ())
        fill = self._fresh_blocks(before, pre_hash, step_no)
        claims = self._claimed_loads(out)
        self._note_scheduled(out, claims, step_no)
        if on_scheduled is not None:
            on_scheduled(self, out)
        t1 = time.monotonic()
        kv_out = self._run_worker(out, fill)
        counters.max_worker_s = max(counters.max_worker_s, time.monotonic() - t1)
        counters.failed_load_blocks += len(kv_out.invalid_block_ids)
        counters.failed_recving += len(kv_out.failed_recving or ())
        self._note_output(kv_out, step_no)
        for claim in claims:
            if claim.block not in kv_out.invalid_block_ids:  # a block reported failed is recomputed by vLLM
                self._verify(claim, step_no, counters, failures)
        self._check_saves(out, step_no, failures, kv_out.invalid_block_ids)
        ids, sampled = self._sampled(out)
        runner_out = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_out,
        )
        self.last_kv_out = kv_out
        self.scheduler.update_from_output(out, runner_out)
        counters.steps += 1
        return out

    def _check_saves(self, out: Any, step_no: int, failures: list[Failure], invalid: set[int]) -> None:
        """Every chunk this step queues for saving must be in its block once the step's forward ran.

        A chunk queued from a block that does not hold it (a failed load, a block not computed yet)
        poisons the pool under a valid key; checked here, where the save is planned. Blocks the
        step reports ``invalid`` are left out: the worker skips every save from them (a request
        that hit such a block in vLLM's prefix cache plans one), which
        ``test_pool_load_failures.py`` checks against the pool itself.
        """
        for r in out.kv_connector_metadata.step.requests:
            if not r.can_save or r.req_id not in self.requests:
                continue
            for j in range(r.save_start_token // BLOCK, min(r.save_end_token // BLOCK, len(r.block_hashes))):
                block = r.block_ids[0][j]
                if block in invalid:
                    continue
                want = self._hashes(r.req_id, (j + 1) * BLOCK)[j * BLOCK :]
                if block_digest(self.caches, block, BLOCK) == expected_digest(want):
                    continue
                k = self.caches[LAYERS[0]][0][block]
                held = "the sentinel" if bool((k == SENTINEL).all()) else "other bytes"
                history = " | ".join(self.history.get(r.req_id, []))
                what = f"save of chunk {j} queued from block {block} holding {held}; history {history}"
                failures.append(Failure(step_no, self.name, r.req_id, block, BLOCK, what, f"save from {held}"))

    def _verify(self, claim: Loaded, step_no: int, counters: Counters, failures: list[Failure]) -> None:
        want = self._hashes(claim.req_id, claim.first_token + claim.slots)[claim.first_token :]
        got = block_digest(self.caches, claim.block, claim.slots)
        counters.verified_blocks += 1
        self.loaded_by_req[claim.req_id] = self.loaded_by_req.get(claim.req_id, 0) + 1
        if got == expected_digest(want):
            return
        k = self.caches[LAYERS[0]][0][claim.block, : claim.slots]
        sentinel = int((k == SENTINEL).all(dim=(1, 2)).sum())
        what = f"{sentinel}/{claim.slots} slots still the sentinel" if sentinel else "another prefix's bytes"
        wrong = [
            f"L{layer}{'KV'[kv]}"
            for layer, name in enumerate(LAYERS)
            for kv in (0, 1)
            if not torch.equal(self.caches[name][kv][claim.block, : claim.slots], slot_values(want, layer, kv))
        ]
        what += f" in {wrong}"
        history = self.history.get(claim.req_id, [])
        shared = any(e.startswith(f"{step_no}:load->{claim.block} shared") for e in history)
        pool = self.inspect(self, claim, want) if self.inspect is not None else ""
        kind = "sentinel" if sentinel else "other bytes"
        kind += ", chunk loaded twice this step" if shared else ", chunk loaded once"
        kind += f", {pool.split(' (')[0].split(';')[0]}"
        what += f"; {pool}; history " + " | ".join(history)
        failures.append(Failure(step_no, self.name, claim.req_id, claim.block, claim.slots, what, kind))

    def close(self) -> None:
        """Shut both roles down (joins their threads, closes the store client and lookup sockets)."""
        self.scheduler.connector.shutdown()  # type: ignore[union-attr]
        self.worker.shutdown()


# ---- leak probes ----


def open_sockets() -> dict[str, str]:
    """Sockets this process holds: inode -> what ``/proc/net`` says of it (local and remote address)."""
    inodes: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = dict.fromkeys(inodes, "?")
    for table in ("tcp", "tcp6", "udp", "unix"):
        try:
            lines = Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            inode = cols[6] if table == "unix" else cols[9]
            if inode in found:
                found[inode] = f"{table} {' '.join(cols[1:3]) if table != 'unix' else ' '.join(cols[7:])}"
    return found


def wait_threads_gone(before: set[threading.Thread], timeout_s: float = 5.0) -> list[str]:
    """Names of threads started since ``before`` still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    left = [t for t in threading.enumerate() if t not in before]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [t for t in threading.enumerate() if t not in before]
    return [t.name for t in left]


def _children(obj: object, path: str) -> list[tuple[object, str]]:
    """What `request_id_refs` walks into: container items, and attributes of our own objects."""
    if isinstance(obj, dict):
        out: list[tuple[object, str]] = []
        for k, v in list(obj.items()):
            out += [(k, f"{path}[key]"), (v, f"{path}[{k!r:.40}]")]
        return out
    if isinstance(obj, list | tuple | set | frozenset):
        return [(v, f"{path}[{i}]") for i, v in enumerate(list(obj))]
    if not type(obj).__module__.startswith("ascend_dist"):
        return []
    items = dict(getattr(obj, "__dict__", {}))
    items.update({n: getattr(obj, n) for n in getattr(type(obj), "__slots__", ()) if hasattr(obj, n)})
    return [(v, f"{path}.{name}") for name, v in items.items()]


def request_id_refs(root: object, ids: set[str], max_depth: int = 8) -> list[str]:
    """Attribute paths under ``root`` (our objects and containers) that still name one of ``ids``.

    The connector's per-request tables must be empty once every request finished; walking the
    object graph (instead of naming tables) keeps this true across refactors of those tables.
    """
    found: list[str] = []
    seen: set[int] = set()
    todo: list[tuple[object, str, int]] = [(root, type(root).__name__, 0)]
    while todo:
        obj, path, depth = todo.pop()
        if isinstance(obj, str):
            if obj in ids:
                found.append(path)
            continue
        if depth > max_depth or id(obj) in seen or isinstance(obj, torch.Tensor | bytes | int | float):
            continue
        seen.add(id(obj))
        todo += [(child, p, depth + 1) for child, p in _children(obj, path)]
    return found
