"""Pool keys: per-rank key metadata, the exact key strings, and which rank writes which key.

Runs in: scheduler and worker processes. Pure planning: no I/O.

Key formats (the fields and their order are part of the pool's
compatibility, so changing them invalidates every stored object):

* whole chunk:
  ``{model}@pcp{p}@dcp{d}@head_or_tp_rank:{h}@pp_rank:{pp}@group:{g}@cache_role:{r}@cache_family:{f}@{hash}``
* partial chunk (only when ``discard_partial_chunks`` is false): the whole-chunk key plus
  ``@partial:{num_tokens}``. Upstream stored a short object under the full chunk's key, so a later
  full-size get failed; a partial object now has its own key.
* per layer: the whole-chunk prefix, then ``layer_id:{L}@{hash}``.
  Upstream omitted ``pp_rank`` here, so layer ids restarting at 0 per PP stage collided.
* GVA block keys (memcache layer-wise): ``{model}@{hash}@{h}`` / ``{model}@{g}@{hash}@{h}``.

The model name is normalised identically on both sides (`normalize_model_name`): upstream's
worker stripped a trailing ``/`` and its scheduler did not, which gave zero hits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ascend_dist.common.errors import ConfigError

__all__ = [
    "KeyMetadata",
    "RankLayout",
    "RankPosition",
    "chunk_hash_hex",
    "gva_block_key",
    "gva_partial_key",
    "normalize_model_name",
    "put_step_and_head",
    "rank_position",
    "write_shard",
]


def normalize_model_name(model: str) -> str:
    """The last path component of a model path or name, ignoring trailing slashes.

    Args:
        model: ``model_config.model`` (a hub name or a local path).

    Returns:
        e.g. ``"Qwen3-8B"`` for ``"/models/Qwen3-8B/"`` and ``"Qwen/Qwen3-8B"``.

    Raises:
        ConfigError: The name is empty after normalisation.
    """
    name = model.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    if not name:
        raise ConfigError("model", model, "a non-empty model name or path")
    return name


def chunk_hash_hex(value: bytes | str) -> str:
    """Render a chunk hash for a key: lower-case hex of bytes; a ``str`` is used verbatim."""
    return value if isinstance(value, str) else value.hex()


def put_step_and_head(tp_size: int, tp_rank: int, num_kv_heads: int, use_mla: bool) -> tuple[int, int]:
    """Which replica set a TP rank belongs to.

    Args:
        tp_size: Tensor-parallel size.
        tp_rank: This rank.
        num_kv_heads: Total KV heads of the model (ignored for MLA, which has one latent head).
        use_mla: Whether the model uses MLA.

    Returns:
        ``(put_step, head_or_tp_rank)``: ranks sharing ``head_or_tp_rank`` hold identical KV and
        ``put_step`` of them share the writing.

    Raises:
        ConfigError: A size or rank is out of range.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError("tp_rank", tp_rank, f"an integer in [0, {tp_size})")
    heads = 1 if use_mla else num_kv_heads
    if heads < 1:
        raise ConfigError("num_kv_heads", num_kv_heads, "a positive integer")
    if heads < tp_size:
        step = tp_size // heads
        return step, tp_rank // step
    return 1, tp_rank


@dataclass(frozen=True)
class RankPosition:
    """Where one worker sits in its engine's parallel layout."""

    tp_rank: int
    pcp_rank: int
    dcp_rank: int
    pp_rank: int


def rank_position(rank: int, *, tp_size: int, pp_size: int = 1, pcp_size: int = 1, dcp_size: int = 1) -> RankPosition:
    """The TP, PCP, DCP and PP ranks of worker ``rank`` of one engine, as vLLM 0.33 lays them out.

    vLLM orders an engine's ranks PP x PCP x TP (TP fastest; ``parallel_state.initialize_model_parallel``
    reshapes ``arange(world)`` to ``(-1, dp, pp, pcp, tp)``). A DCP group is ``dcp_size`` consecutive
    entries of each stage's ranks read TP-major, PCP-minor (vLLM transposes the last two axes when
    DCP > 1: "DCP spans PCP first, then TP"). Upstream took ``pp_rank = rank // tp`` (wrong with
    PCP > 1) and never set the PCP/DCP ranks, so every rank wrote ``@pcp0@dcp0`` keys.

    Raises:
        ConfigError: A size is not positive or ``rank`` is outside the engine.
    """
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("pcp_size", pcp_size), ("dcp_size", dcp_size)):
        if value < 1:
            raise ConfigError(name, value, "a positive integer")
    world = tp_size * pp_size * pcp_size
    if not 0 <= rank < world:
        raise ConfigError("rank", rank, f"a worker rank in [0, {world})")
    if (tp_size * pcp_size) % dcp_size:
        raise ConfigError("dcp_size", dcp_size, f"a divisor of TP x PCP = {tp_size * pcp_size}")
    tp, pcp, pp = rank % tp_size, (rank // tp_size) % pcp_size, rank // (tp_size * pcp_size)
    return RankPosition(tp_rank=tp, pcp_rank=pcp, dcp_rank=(tp * pcp_size + pcp) % dcp_size, pp_rank=pp)


def _variant_of(pos: RankPosition, tp_size: int, num_kv_heads: int, use_mla: bool) -> tuple[int, int, int, int]:
    head = put_step_and_head(tp_size, pos.tp_rank, num_kv_heads, use_mla)[1]
    return pos.pcp_rank, pos.dcp_rank, pos.pp_rank, head


def write_shard(
    rank: int, *, tp_size: int, pp_size: int = 1, pcp_size: int = 1, dcp_size: int = 1, num_kv_heads: int, use_mla: bool
) -> tuple[int, int]:
    """``(shard_rank, shard_size)``: how worker ``rank`` splits writes with the ranks holding identical KV.

    Identical KV means the same ``(pcp, dcp, pp, head)`` key variant. Without DCP these are the TP
    ranks of one replica set and this is ``(tp_rank % put_step, put_step)``; with DCP each replica
    set splits into DCP shards of different tokens, which must not share the writing.

    Raises:
        ConfigError: See `rank_position`.
    """
    sizes = {"tp_size": tp_size, "pp_size": pp_size, "pcp_size": pcp_size, "dcp_size": dcp_size}
    mine = _variant_of(rank_position(rank, **sizes), tp_size, num_kv_heads, use_mla)
    peers = [
        r
        for r in range(tp_size * pp_size * pcp_size)
        if _variant_of(rank_position(r, **sizes), tp_size, num_kv_heads, use_mla) == mine
    ]
    return peers.index(rank), len(peers)


@dataclass(frozen=True, kw_only=True)
class KeyMetadata:
    """The identity fields of every key one rank writes for one KV-cache group."""

    model_name: str
    head_or_tp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0
    pp_rank: int = 0
    kv_cache_group_id: int = 0
    cache_role: str = "kv"
    cache_family: str = "default"

    def __post_init__(self) -> None:
        """Normalise the model name so scheduler and worker always agree."""
        object.__setattr__(self, "model_name", normalize_model_name(self.model_name))

    @cached_property
    def prefix(self) -> str:
        """Everything of a whole-chunk key before the hash, including the trailing ``@``."""
        return (
            f"{self.model_name}@pcp{self.pcp_rank}@dcp{self.dcp_rank}"
            f"@head_or_tp_rank:{self.head_or_tp_rank}@pp_rank:{self.pp_rank}"
            f"@group:{self.kv_cache_group_id}@cache_role:{self.cache_role}@cache_family:{self.cache_family}@"
        )

    def pool_key(self, chunk_hash: bytes | str) -> str:
        """The whole-chunk key of ``chunk_hash``."""
        return self.prefix + chunk_hash_hex(chunk_hash)

    def partial_key(self, chunk_hash: bytes | str, num_tokens: int) -> str:
        """The key of a partial chunk holding only its first ``num_tokens`` tokens."""
        return f"{self.prefix}{chunk_hash_hex(chunk_hash)}@partial:{num_tokens}"

    def layer_key(self, chunk_hash: bytes | str, layer_id: int) -> str:
        """The per-layer key of ``chunk_hash`` (layer-wise path; includes ``pp_rank``)."""
        return f"{self.prefix}layer_id:{layer_id}@{chunk_hash_hex(chunk_hash)}"

    def layer_keys(self, chunk_hash: bytes | str, num_layers: int) -> list[str]:
        """Per-layer keys for layers ``0..num_layers-1`` (upstream ``split_layers``)."""
        return [self.layer_key(chunk_hash, layer) for layer in range(num_layers)]

    def for_rank(self, *, head: int, pp: int, pcp: int = 0, dcp: int = 0) -> KeyMetadata:
        """The same metadata as seen by another rank."""
        return replace(self, head_or_tp_rank=head, pp_rank=pp, pcp_rank=pcp, dcp_rank=dcp)


def gva_block_key(model: str, chunk_hash: bytes | str, head_or_tp_rank: int, group: int | None = None) -> str:
    """Key of a whole block holding all layers (memcache GVA path)."""
    name = normalize_model_name(model)
    if group is None:
        return f"{name}@{chunk_hash_hex(chunk_hash)}@{head_or_tp_rank}"
    return f"{name}@{group}@{chunk_hash_hex(chunk_hash)}@{head_or_tp_rank}"


def gva_partial_key(model: str, req_id: str, *, group: int, block_index: int, end_token: int, head: int) -> str:
    """Request-scoped key of a trailing partial block (never shared across requests)."""
    return f"{normalize_model_name(model)}@partial@{req_id}@{group}@{block_index}@{end_token}@{head}"


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """The parallel layout that decides how many distinct key variants one chunk has.

    A chunk is a pool hit only if the keys of every rank holding distinct data exist. Unlike
    upstream, PCP and DCP ranks are expanded too.
    """

    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    num_kv_heads: int = 1
    use_mla: bool = False
    group_kv_heads: Sequence[int] = field(default_factory=tuple)
    _prefixes: dict[KeyMetadata, tuple[str, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )  # every lookup expands keys: building the per-variant prefixes once saves ~15 us per variant

    def __post_init__(self) -> None:
        """Validate the sizes."""
        for name in ("tp_size", "pp_size", "pcp_size", "dcp_size", "num_kv_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "a positive integer")

    def group_tp_size(self, group: int) -> int:
        """How many distinct ``head_or_tp_rank`` values group ``group`` has."""
        heads = self.group_kv_heads[group] if group < len(self.group_kv_heads) else self.num_kv_heads
        heads = 1 if self.use_mla else heads
        return min(self.tp_size, heads)

    def rank_variants(self, group: int) -> Iterator[tuple[int, int, int, int]]:
        """Every distinct ``(pcp, dcp, pp, head)`` some rank of ``group`` writes, sorted.

        Without DCP that is every combination. With DCP only the pairs `rank_position` gives some
        rank exist (e.g. DCP = PCP: ``dcp == pcp``), so the full product would never hit.
        """
        if self.dcp_size == 1:
            for pcp in range(self.pcp_size):
                for pp in range(self.pp_size):
                    for head in range(self.group_tp_size(group)):
                        yield pcp, 0, pp, head
            return
        total = self.group_kv_heads[group] if group < len(self.group_kv_heads) else self.num_kv_heads
        found: set[tuple[int, int, int]] = set()
        for rank in range(self.pcp_size * self.tp_size):  # one PP stage: every stage has the same pairs
            pos = rank_position(rank, tp_size=self.tp_size, pcp_size=self.pcp_size, dcp_size=self.dcp_size)
            found.add(
                (pos.pcp_rank, pos.dcp_rank, put_step_and_head(self.tp_size, pos.tp_rank, total, self.use_mla)[1])
            )
        yield from sorted((pcp, dcp, pp, head) for pcp, dcp, head in found for pp in range(self.pp_size))

    def num_variants(self, group: int) -> int:
        """How many key variants one chunk of ``group`` has."""
        if self.dcp_size == 1:
            return self.pcp_size * self.pp_size * self.group_tp_size(group)
        return sum(1 for _ in self.rank_variants(group))

    def expand(self, meta: KeyMetadata, hashes: Sequence[bytes | str]) -> list[str]:
        """All-rank keys of ``hashes``: ``[variant0 keys..., variant1 keys..., ...]``.

        Example: GQA 8 heads, TP=4, PP=2, 3 chunks -> 2 x 4 x 3 = 24 keys.
        """
        hexes = [h if isinstance(h, str) else h.hex() for h in hashes]
        out: list[str] = []
        for prefix in self.variant_prefixes(meta):
            out.extend([prefix + h for h in hexes])
        return out

    def variant_prefixes(self, meta: KeyMetadata) -> tuple[str, ...]:
        """The whole-chunk key prefix of every rank variant of ``meta``'s group, rank-major."""
        cached = self._prefixes.get(meta)
        if cached is None:
            cached = tuple(
                meta.for_rank(head=head, pp=pp, pcp=pcp, dcp=dcp).prefix
                for pcp, dcp, pp, head in self.rank_variants(meta.kv_cache_group_id)
            )
            self._prefixes[meta] = cached
        return cached

    def expand_layers(self, meta: KeyMetadata, hashes: Sequence[bytes | str], stage_layers: Sequence[int]) -> list[str]:
        """All-rank, all-layer keys of ``hashes`` (layer-wise lookups), one row per (variant, layer).

        Rows are ordered variant-major, then layer: ``[v0 L0 keys..., v0 L1 keys..., v1 L0 ...]``.
        ``stage_layers[pp]`` is the number of layers PP stage ``pp`` stores (layer ids restart at 0
        per stage; the key's ``pp_rank`` keeps them apart).
        """
        hexes = [h if isinstance(h, str) else h.hex() for h in hashes]
        out: list[str] = []
        variants = self.rank_variants(meta.kv_cache_group_id)
        for (_, _, pp, _), prefix in zip(variants, self.variant_prefixes(meta), strict=True):
            for layer in range(stage_layers[pp] if pp < len(stage_layers) else stage_layers[-1]):
                layer_prefix = f"{prefix}layer_id:{layer}@"
                out.extend([layer_prefix + h for h in hexes])
        return out
