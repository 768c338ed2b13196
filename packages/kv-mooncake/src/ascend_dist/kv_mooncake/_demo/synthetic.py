"""A synthetic P or D instance: paged KV caches, a block allocator, the real scheduler and workers.

Runs in: the ``pd`` demo/bench scenario, the package's tests and the P child process
(`ascend_dist.kv_mooncake._demo.pd_peer`). Every worker of the instance (TP x PP ranks) lives in this
process and shares its Mooncake engine; P and D are separate processes. KV contents are a
deterministic function of (request seed, layer, part, global head, token position, element), so D
can verify every byte it pulled without seeing P's memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import DeploymentSecret, load_secret
from ascend_dist.kv_mooncake._demo.synthetic_common import aggregate_ranks, wait_received
from ascend_dist.kv_mooncake._demo.synthetic_layouts import NATIVE_LAYOUTS, build_attention_caches
from ascend_dist.kv_mooncake._demo.synthetic_state import StateShape
from ascend_dist.kv_mooncake.core.blocks import pp_layer_ranges
from ascend_dist.kv_mooncake.core.engine import Reader
from ascend_dist.kv_mooncake.core.kv_views import label_kv_caches
from ascend_dist.kv_mooncake.core.ranks import head_range
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.scheduler import PullScheduler, SchedRequest
from ascend_dist.kv_mooncake.pull.worker import PullWorker

__all__ = ["Model", "SyntheticInstance", "block_view", "pattern"]


@dataclass(frozen=True)
class Model:
    """Shape of the synthetic model.

    Attributes:
        layers: Transformer layers.
        heads: Total KV heads (ignored for MLA).
        head_dim: Elements per head (MLA: the first part's width).
        block_size: Tokens per block.
        num_blocks: Blocks per tensor on each rank.
        mla: One replicated latent cache with two parts (``head_dim`` and ``head_dim // 8``).
        groups: KV-cache groups (layer i belongs to group ``i % groups``).
        windows: Per group, ``ceil(window / block) + 1`` for a sliding-window group, else 0
            (empty: no sliding window).
        state_groups: Groups whose layers are state (Mamba/GDN) layers (`synthetic_state`).
        state: Sizes of a state layer (a dict of `StateShape` fields).
        kernel_block_size: Tokens of the attention kernel's block (0: ``block_size``); the
            tensors then hold ``block_size / kernel_block_size`` kernel blocks per logical block.
        layout: How the attention tensors are laid out (`synthetic_layouts.LAYOUTS`): ``""``
            vllm-ascend's (K, V) tuple, ``legacy-NHD``/``legacy-HND`` one ``[2, ...]`` tensor, or a
            vLLM >= 0.32 layout name (``LBHNC``, ``LBNHC``, ``BLHNC``, ...).
    """

    layers: int = 4
    heads: int = 4
    head_dim: int = 64
    block_size: int = 16
    num_blocks: int = 64
    mla: bool = False
    groups: int = 1
    windows: tuple[int, ...] = ()
    state_groups: tuple[int, ...] = ()
    state: dict[str, int] = field(default_factory=dict)
    kernel_block_size: int = 0
    layout: str = ""

    @property
    def state_shape(self) -> StateShape:
        """The state layers' sizes."""
        return StateShape(**self.state)

    def is_state(self, layer: int) -> bool:
        """Whether layer ``layer`` is a state layer."""
        return layer % self.groups in self.state_groups

    def layer_name(self, i: int) -> str:
        """vLLM-style layer name."""
        return f"model.layers.{i}.self_attn.attn"

    def part_dims(self) -> list[int]:
        """Element width of each tensor of a layer."""
        return [self.head_dim, max(1, self.head_dim // 8)] if self.mla else [self.head_dim, self.head_dim]


def block_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[blocks * s, kernel, heads, dim]`` as ``[blocks, s, kernel, heads, dim]`` (a view, any strides)."""
    return t.unflatten(0, (num_blocks, -1))


def pattern(
    seed: int, layer: int, part: int, heads: torch.Tensor, positions: torch.Tensor, *, dim: int
) -> torch.Tensor:
    """Expected int16 contents ``[len(positions), tokens, len(heads), dim]`` for positions ``[n, tokens]``."""
    d = torch.arange(dim, dtype=torch.int64)
    v = (
        seed * 1_000_003
        + layer * 7_919
        + part * 104_729
        + heads[None, None, :, None] * 1_299_709
        + positions[:, :, None, None] * 15_485_863
        + d[None, None, None, :]
    )
    return (v % 32_749).to(torch.int16)


@dataclass
class _Rank:
    tp: int
    pp: int
    cp_index: int
    layers: list[int]
    caches: dict[str, tuple[torch.Tensor, ...]]
    worker: PullWorker


@dataclass
class SyntheticInstance:
    """One P or D instance with all its worker ranks in this process."""

    config: PullConfig
    model: Model
    engine: Reader | None = None
    ranks: list[_Rank] = field(default_factory=list)
    p_block_size: int = 0
    secret: DeploymentSecret | None = field(default_factory=load_secret)  # as a deployment's nodes read it
    # The ranks (in TP, then PCP, then PP order) this process runs; empty = all. A P instance spanning
    # nodes runs one process per node, each with the same scheduler decisions and its own ranks.
    local_ranks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        topo = self.config.prefill if self.config.is_producer else self.config.decode
        self.tp, self.pp = topo.tp_size, topo.pp_size
        self.pcp, self.dcp = topo.pcp_size, topo.dcp_size
        self.cp = self.pcp * self.dcp  # block i of a request's list on CP index q is block i*cp + q
        self.scheduler = PullScheduler(
            self.config,
            [self.model.block_size] * self.model.groups,
            list(self.model.windows),
            state_groups=list(self.model.state_groups),
            secret=self.secret,
        )
        ids = list(range(1, self.model.num_blocks))
        # Each group's free list starts elsewhere, so a plan that mixes up groups' ids is caught.
        self.free: list[list[int]] = [ids[5 * g :] + ids[: 5 * g] for g in range(self.model.groups)]
        self.blocks: dict[str, list[list[int]]] = {}
        self.requests: dict[str, SchedRequest] = {}
        stages = pp_layer_ranges(self.model.layers, self.pp, topo.pp_layer_partition)
        order = [(tp, pp, pcp) for pp in range(self.pp) for pcp in range(self.pcp) for tp in range(self.tp)]
        for i, (tp, pp, pcp) in enumerate(order):
            if not self.local_ranks or i in self.local_ranks:
                self.ranks.append(self._make_rank(tp, pp, list(range(*stages[pp])), pcp))

    def _heads(self, tp: int) -> tuple[int, int]:
        return (0, 1) if self.model.mla else head_range(tp, self.tp, self.model.heads)

    def _make_rank(self, tp: int, pp: int, layers: list[int], pcp: int = 0) -> _Rank:
        m = self.model
        _, count = self._heads(tp)
        kernel = m.kernel_block_size or m.block_size  # kernel blocks: [blocks * scale, kernel, ...]
        attention = [m.layer_name(i) for i in layers if not m.is_state(i)]
        built = build_attention_caches(
            m.layout,
            attention,
            blocks=m.num_blocks * (m.block_size // kernel),
            tokens=kernel,
            heads=count,
            dims=m.part_dims(),
            mla=m.mla,
        )
        raw: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = dict(built.raw)
        caches: dict[str, tuple[torch.Tensor, ...]] = dict(built.rows)
        for i in layers:
            if m.is_state(i):
                raw[m.layer_name(i)] = caches[m.layer_name(i)] = m.state_shape.empty(m.num_blocks, self.tp)
        native = m.layout in NATIVE_LAYOUTS
        parts, layout = label_kv_caches(
            {m.layer_name(i): raw[m.layer_name(i)] for i in layers},
            native=native,
            layout_name=m.layout if native else "",
        )
        worker = PullWorker(
            self.config,
            tp_rank=tp,
            pp_rank=pp,
            pcp_rank=pcp,
            num_kv_heads=m.heads,
            use_mla=m.mla,
            engine=self.engine,
            secret=self.secret,
        )
        groups = [[m.layer_name(i) for i in layers if i % m.groups == g] for g in range(m.groups)]
        p_tp = self.config.prefill.tp_size
        worker.register_kv_caches(
            parts,
            groups=groups,
            num_blocks=m.num_blocks,
            block_size=m.block_size,
            state_groups=list(m.state_groups),
            state_layout=m.state_shape.layout(p_tp) if m.state_groups and p_tp > self.tp else None,
            layout=layout,
        )
        return _Rank(tp, pp, pcp * self.dcp + tp % self.dcp, layers, caches, worker)

    def _alloc(self, rid: str, tokens: int) -> list[list[int]]:
        n = -(-tokens // (self.model.block_size * self.cp))
        if any(len(f) < n for f in self.free):
            raise ConfigError("num_blocks", self.model.num_blocks, f"enough free blocks for {n} more")
        ids = [[f.pop(0) for _ in range(n)] for f in self.free]
        self.blocks[rid] = ids
        return ids

    def release(self, rid: str) -> None:
        """Return a request's blocks to the free lists."""
        for free, ids in zip(self.free, self.blocks.pop(rid, []), strict=False):
            free.extend(ids)
        self.requests.pop(rid, None)

    def _step(self) -> None:
        meta = self.scheduler.build_connector_meta()
        for r in self.ranks:
            r.worker.start_load_kv(meta)

    def prefill(
        self, rid: str, prompt_len: int, seed: int, *, end: str = "length", preempt: bool = False
    ) -> dict[str, object]:
        """P: run a request's prefill (fill its KV with the pattern) and return kv_transfer_params.

        ``end``: how the request ends on P: ``"length"`` (max_tokens reached, the P/D hand-off),
        or ``"stopped"`` / ``"aborted"`` (EOS on the first token, a client abort): then nothing is
        lent, the blocks are freed at once and ``{}`` is returned. ``preempt``: vLLM preempts the
        request after its first step (its blocks freed) and schedules it again into other blocks.
        """
        req = SchedRequest(rid, prompt_len, {"do_remote_decode": True})
        self.requests[rid] = req
        self.scheduler.truncate_for_state(req)  # a hybrid model drops the last prompt token (vLLM: on_new_request)
        ids = self._alloc(rid, req.prompt_len)
        self.scheduler.update_state_after_alloc(req, ids, 0)
        self._step()
        if preempt:
            freed = self.blocks.pop(rid)
            ids = self._alloc(rid, req.prompt_len)  # other blocks: the free lists hand out from the front
            for free, old in zip(self.free, freed, strict=True):
                free.extend(old)
            self.scheduler.update_state_after_alloc(req, ids, 0)
            self._step()
        self.fill(rid, seed, 0)
        req.length_capped = end == "length"
        delay, params = self.scheduler.request_finished(req, ids)
        self._step()
        if end != "length":
            if delay or params is not None:
                raise ConfigError("end", end, "a request P frees at once (it lends nothing)")
            self.release(rid)
            return {}
        if not delay or params is None:
            raise ConfigError("prompt_len", prompt_len, "a prompt that yields blocks to send")
        return params

    def fill(self, rid: str, seed: int, first_position: int) -> None:
        """Write the pattern into a request's blocks on every rank."""
        m = self.model
        for r in self.ranks:
            first, count = self._heads(r.tp)
            heads = torch.arange(first, first + count)
            for i in r.layers:
                ids = self.blocks[rid][i % m.groups]
                if m.is_state(i):
                    self._fill_state(r, i, ids, seed)
                    continue
                pos = self._positions(first_position // m.block_size, r.cp_index, len(ids))
                for part, t in enumerate(r.caches[m.layer_name(i)]):
                    want = pattern(seed, i, part, heads, pos, dim=t.shape[3])
                    block_view(t, m.num_blocks)[torch.tensor(ids)] = want.unflatten(1, (-1, t.shape[1]))

    def _fill_state(self, r: _Rank, layer: int, ids: Sequence[int], seed: int) -> None:
        """P's state blocks of a request: the last holds the request's state, the others decoys."""
        conv, ssm = r.caches[self.model.layer_name(layer)]
        for j, b in enumerate(ids):
            s = seed if j == len(ids) - 1 else seed + 7_919 * (j + 1)
            conv[b], ssm[b] = self.model.state_shape.contents(s, layer, r.tp, self.tp)

    def _verify_state(self, r: _Rank, layer: int, ids: Sequence[int], seed: int) -> int:
        """D's state block (its first new block) against P's state; returns bytes checked."""
        conv, ssm = r.caches[self.model.layer_name(layer)]
        want = self.model.state_shape.contents(seed, layer, r.tp, self.tp)
        for got, exp in zip((conv[ids[0]], ssm[ids[0]]), want, strict=True):
            if not torch.equal(got, exp):
                raise AssertionError(f"layer {layer} state rank tp{r.tp} differs from P's state")
        return (conv[0].numel() + ssm[0].numel()) * 2

    def decode(self, rid: str, prompt_len: int, params: dict[str, object], computed_tokens: int = 0) -> int:
        """D: accept P's params, allocate, queue the pull; returns the tokens to load."""
        req = SchedRequest(rid, prompt_len, dict(params))
        self.requests[rid] = req
        count, _ = self.scheduler.get_num_new_matched_tokens(req, computed_tokens)
        ids = self._alloc(rid, count)
        self.scheduler.update_state_after_alloc(req, ids, count)
        self._step()
        return count

    def poll(self) -> tuple[set[str], set[str], set[int]]:
        """Aggregate over ranks: (finished_sending, finished_recving, load-error block ids).

        A request counts as finished only once every rank reported it (as vLLM aggregates).
        """
        sending: list[set[str]] = []
        recving: list[set[str]] = []
        errors: set[int] = set()
        for r in self.ranks:
            errors |= r.worker.get_block_ids_with_load_errors()
            s, v = r.worker.get_finished()
            sending.append(s)
            recving.append(v)
        self._seen_s = getattr(self, "_seen_s", {})
        self._seen_r = getattr(self, "_seen_r", {})
        n = len(self.ranks)
        return aggregate_ranks(self._seen_s, sending, n), aggregate_ranks(self._seen_r, recving, n), errors

    def wait_recv(self, rids: set[str], timeout_s: float) -> set[int]:
        """D: poll until every request in ``rids`` finished receiving; return load errors seen."""
        return wait_received(lambda: self.poll()[1:], rids, timeout_s)

    def _positions(self, first_block: int, cp_index: int, n: int) -> torch.Tensor:
        """Token positions ``[n, block]`` of a CP rank's list entries from global block ``first_block`` on."""
        first = first_block + (cp_index - first_block) % self.cp
        blocks = first + torch.arange(n) * self.cp
        return blocks[:, None] * self.model.block_size + torch.arange(self.model.block_size)[None, :]

    @property
    def _p_block(self) -> int:
        """P's block size: P filled whole blocks of it (this instance's own when it is P)."""
        return self.p_block_size or self.model.block_size

    def verify(self, rid: str, seed: int, computed_tokens: int = 0) -> int:
        """D: compare every pulled byte of a request with the pattern; return bytes checked.

        Bytes up to the end of P's last prompt block are compared (P writes whole blocks).
        """
        m = self.model
        checked = 0
        first_block = computed_tokens // m.block_size
        for r in self.ranks:
            first, count = self._heads(r.tp)
            heads = torch.arange(first, first + count)
            for i in r.layers:
                ids = self.blocks[rid][i % m.groups]
                if m.is_state(i):
                    checked += self._verify_state(r, i, ids, seed) if ids else 0
                    continue
                window = m.windows[i % m.groups] if m.windows else 0
                skip = max(0, len(ids) - window) if window else 0  # a SWA group: only its window's tail
                ids = ids[skip:]
                pos = self._positions(first_block + skip, r.cp_index, len(ids))
                loaded = self.scheduler.loaded_len(self.requests[rid].prompt_len) if rid in self.requests else 1 << 30
                # Tokens past the loaded prompt were never computed by P (a last, partly filled block).
                mask = pos < max(loaded, -(-loaded // self._p_block) * self._p_block)
                keep = int(mask[:, 0].sum())  # CP: a rank's last entry may be past the prompt
                ids, pos, mask = ids[:keep], pos[:keep], mask[:keep]
                if not ids:
                    continue
                for part, t in enumerate(r.caches[m.layer_name(i)]):
                    got = block_view(t, m.num_blocks)[torch.tensor(ids)].flatten(1, 2)
                    want = pattern(seed, i, part, heads, pos, dim=t.shape[3])
                    if not torch.equal(got[mask], want[mask]):
                        raise AssertionError(f"{rid}: layer {i} part {part} rank tp{r.tp} differs from P's bytes")
                    checked += got[mask].numel() * got.element_size()
        return checked

    def finish_decode(self, rid: str) -> None:
        """D: the request finished; free its blocks."""
        req = self.requests.get(rid)
        if req is not None:
            self.scheduler.request_finished(req, self.blocks.get(rid, []))
        self.release(rid)

    def shutdown(self) -> None:
        """Stop every worker."""
        for r in self.ranks:
            r.worker.shutdown()
