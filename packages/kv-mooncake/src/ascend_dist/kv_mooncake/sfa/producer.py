"""P's worker half of the SFA remote-D2H connector.

Runs in: every P worker process. Call order per step, as vLLM's model runner makes it:
`start_load_kv` (this step's chunks) -> per attention layer: `wait_for_layer_load` (the reuse
gate: waits until D finished reading what the previous step dispatched for this layer's storage)
-> the layer writes its KV -> `on_kv_cache_written` or `save_kv_layer` (dispatch once per step:
tell each D endpoint the layer's blocks are readable) -> `get_finished` (nothing: P frees its
blocks at once, the gates protect them). After a request's last layer was answered, P's link
sends D its verdict (`Commit`): only reads answered before P's deadline count.

P never moves bytes itself: D reads P's memory with its engine. P's only duties are to describe
its memory (`Hello`), to say when a layer's chunk is ready (`ReadReady`), and not to overwrite a
layer's blocks before D's answer (or the deadline).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ascend_dist.common.errors import BlockIdError, ConfigError, DeadlineExceeded, LayoutError, TransferError
from ascend_dist.common.regions import (
    RegisterRegions,
    collect_storage_merged_register_regions,
    validate_register_region_count,
)
from ascend_dist.common.wire import Handshake
from ascend_dist.kv_mooncake.core.engine import Reader
from ascend_dist.kv_mooncake.core.kv_geometry import CacheLayout, layout_label
from ascend_dist.kv_mooncake.core.kv_views import tensor_geometry
from ascend_dist.kv_mooncake.core.tcp_sockets import process_incarnation
from ascend_dist.kv_mooncake.sfa.config import SfaConfig
from ascend_dist.kv_mooncake.sfa.links import Dispatcher, Part, Slot
from ascend_dist.kv_mooncake.sfa.messages import (
    CHANNEL,
    Hello,
    LayerMeta,
    ReadReady,
    ReadReq,
    TensorSpan,
)
from ascend_dist.kv_mooncake.sfa.plan import chunk_block_range, contributor_of, d_endpoint_port, layer_index
from ascend_dist.kv_mooncake.sfa.step_metadata import ProducerMetadata, SendReq

__all__ = ["KVCaches", "ProducerWorker", "make_sfa_handshake", "span_label", "tensor_span"]

logger = logging.getLogger(__name__)

KVCaches = Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
_GATE_LOG_S = 10.0


def tensor_span(name: str, t: torch.Tensor, layout: CacheLayout | None = None) -> TensorSpan:
    """``(base, bytes per logical block)`` of a ``[blocks, ...]`` tensor whose blocks are dense.

    3-D and 4-D tensors are read like the pull connector's (`kv_views.tensor_geometry`: vLLM's
    ``[B, H, N, C]`` views by their strides, either order inside a block); SFA reads whole blocks,
    so they must also lie back to back.

    Raises:
        LayoutError: The tensor's layout cannot be served, or its blocks are not back to back
            (block-outermost layouts); the error names the layout.
    """
    elt = t.element_size()
    if t.dim() in (3, 4):
        g = tensor_geometry(name, t, t.shape[0], layout)
        if g.stride != g.block_len:
            raise LayoutError(
                f"{name} kv_cache_layout",
                (layout.name if layout else "") or f"strides {tuple(t.stride())}",
                f"blocks back to back (block stride {g.stride} = block bytes {g.block_len}): SFA reads whole "
                "blocks; a block-outermost layout (BLHNC, BLNHC) interleaves the layers' pages",
            )
        return TensorSpan(g.base, g.block_len)
    block = elt * (t[0].numel() if t.shape[0] else 0)
    if t.dim() < 2 or t.stride(0) * elt != block or not t[0].is_contiguous():
        raise LayoutError(f"{name}.stride", tuple(t.stride()), "dense blocks: [blocks, ...] with contiguous blocks")
    return TensorSpan(t.data_ptr(), block)


def span_label(layout: CacheLayout | None, tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """The layout's name as P and D compare it at the hello (see `kv_geometry.layout_label`)."""
    geoms = [tensor_geometry(n, t, t.shape[0], layout) for n, t in tensors if t.dim() in (3, 4)]
    return layout_label(layout or CacheLayout(), geoms)


def _tensors(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


def make_sfa_handshake(config: SfaConfig, sender: str, layers: int, layout: str = "NHD") -> Handshake:
    """The values P and D must agree on (a mismatch names the field); ``layout`` from `span_label`."""
    return CHANNEL.handshake(
        sender=sender,
        model=config.model,
        dtype=config.dtype,
        layers=layers,
        layout=layout,
        prefill_tp=config.prefill.tp_size,
        decode_tp=config.decode.tp_size,
        # D counts a request received on P's Commit (not at its last read): a peer that still
        # counts at the last read must be refused, naming this field.
        completion="p-commit",
    )


@dataclass(frozen=True)
class _Layer:
    name: str
    meta: LayerMeta
    slots: tuple[Slot, ...]


class ProducerWorker:
    """P's worker: registration, layer dispatch, reuse gates."""

    def __init__(self, config: SfaConfig, *, tp_rank: int, backend: Reader) -> None:
        """Create the worker (nothing starts before `register_kv_caches`).

        Raises:
            ConfigError: ``tp_rank`` out of range or the TP sizes do not divide.
        """
        contributor_of(tp_rank, config.prefill.tp_size, config.decode.tp_size)
        self._config = config
        self._tp_rank = tp_rank
        self._backend = backend
        self._registered: RegisterRegions | None = None  # unregistered by shutdown
        self._sender = f"{config.engine_id}/tp{tp_rank}"
        self._layers: dict[str, _Layer] = {}
        self._gates: dict[str, tuple[Slot, ...]] = {}
        self._last_layer = -1
        self._block_sizes = (0, 0)
        self._hello: Hello | None = None
        self._dispatcher = Dispatcher(config, self._make_hello)
        self._reqs: tuple[SendReq, ...] = ()
        self._dispatched: set[str] = set()

    def gates(self, layer_name: str) -> tuple[Slot, ...]:
        """The reuse gates a layer waits on (layers sharing storage share them)."""
        return self._gates.get(layer_name, ())

    @property
    def dispatcher(self) -> Dispatcher:
        """The endpoint links (tests read its counters)."""
        return self._dispatcher

    def _make_hello(self) -> Hello:
        if self._hello is None:
            raise ConfigError("register_kv_caches", "not called", "called before the first layer is dispatched")
        return self._hello

    def register_kv_caches(
        self,
        kv_caches: KVCaches,
        *,
        block_size: int,
        indexer_block_size: int = 0,
        layout: CacheLayout | None = None,
    ) -> None:
        """Describe and register the caches: per layer its main tensor(s), then its indexer tensors.

        Args:
            kv_caches: Layer name -> tensor(s); names with "indexer" hold the indexer cache of the
                transformer layer with the same ``layers.<i>`` index.
            block_size: Tokens per block of the main group.
            indexer_block_size: Tokens per block of the indexer group (0: same as main).
            layout: The tensors' logical axes and the engine's layout name
                (`kv_views.label_kv_caches`); default vllm-ascend's forms.

        Raises:
            LayoutError: A main layer has other than two tensors, an indexer has no main layer, or
                blocks are not dense (the error names the layout).
            NativeLibraryError: The engine refused a region.
        """
        mains: dict[int, tuple[str, list[torch.Tensor]]] = {}
        indexers: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for name, value in kv_caches.items():
            idx, ts = layer_index(name), _tensors(value)
            if "indexer" in name:
                indexers.setdefault(idx, []).extend((name, t) for t in ts)
            elif len(ts) not in (1, 2):
                raise LayoutError(name, len(ts), "1 (vLLM's MLA) or 2 (Ascend's nope/rope) main tensors")
            else:
                mains[idx] = (name, ts)
        if orphans := sorted(set(indexers) - set(mains)):
            raise LayoutError("indexer layers", orphans, "an indexer only beside a main layer of the same index")
        slots: dict[tuple[int, ...], Slot] = {}
        for idx, (name, ts) in sorted(mains.items()):
            main = [tensor_span(name, t, layout) for t in ts]
            idx_spans = [tensor_span(n, t, layout) for n, t in indexers.get(idx, [])]
            keys = [tuple(s.base for s in main)] + ([tuple(s.base for s in idx_spans)] if idx_spans else [])
            layer_slots = tuple(slots.setdefault(k, Slot()) for k in keys)  # shared storage, shared gate
            self._layers[name] = _Layer(name, LayerMeta(layer_idx=idx, main=main, indexer=idx_spans), layer_slots)
        for name in kv_caches:
            self._gates[name] = self._layers[mains[layer_index(name)][0]].slots
        self._last_layer = max(mains, default=-1)
        self._block_sizes = (block_size, indexer_block_size or block_size)
        regions = collect_storage_merged_register_regions([_tensors(v) for v in kv_caches.values()])
        validate_register_region_count(regions)  # <= 256 regions per process (HCCL, MemFabric)
        self._backend.register(regions)
        self._registered = regions
        session = self._backend.session
        label = span_label(layout, [(n, t) for n, v in kv_caches.items() for t in _tensors(v)])
        self._hello = Hello(
            handshake=make_sfa_handshake(self._config, self._sender, len(mains), label),
            engine_id=self._config.engine_id,
            sender=self._sender,
            session=session,
            layers={layer.name: layer.meta for layer in self._layers.values()},
            incarnation=process_incarnation(),
            transport_ports=tuple(self._backend.transport_ports),
        )

    def start_load_kv(self, meta: ProducerMetadata) -> None:
        """Take this step's chunks; every layer may be dispatched once again."""
        self._reqs = meta.requests
        self._dispatched = set()

    def on_kv_cache_written(self, layer_name: str, ready: Callable[[], None] | None = None) -> None:
        """Early hook right after the layer's KV scatter: dispatch now (D's read overlaps attention)."""
        self._dispatch(layer_name, ready)

    def save_kv_layer(self, layer_name: str, ready: Callable[[], None] | None = None) -> None:
        """Fallback hook after the layer: dispatch unless `on_kv_cache_written` already did."""
        self._dispatch(layer_name, ready)

    def _read_req(self, r: SendReq, layer: _Layer) -> ReadReq | None:
        bs, ibs = self._block_sizes
        if not r.main_block_ids or (layer.meta.indexer and not (r.indexer_block_ids or ibs == bs)):
            return None  # requests lacking the layer's blocks are skipped
        cached, done, fin = r.cached_tokens, r.transferred_tokens, r.chunk_finish
        s, e = chunk_block_range(
            cached_tokens=cached,
            transferred_tokens=done,
            computed_tokens=r.computed_tokens,
            block_size=bs,
            finished=fin,
            allocated=len(r.main_block_ids),
        )
        p_idx: list[int] = []
        si = 0
        if layer.meta.indexer:
            ids = r.indexer_block_ids or r.main_block_ids
            si, ei = chunk_block_range(
                cached_tokens=cached,
                transferred_tokens=done,
                computed_tokens=r.computed_tokens,
                block_size=ibs,
                finished=fin,
                allocated=len(ids),
            )
            p_idx = list(ids[si:ei])
        return ReadReq(r.ext_id, list(r.main_block_ids[s:e]), p_idx, s, si)

    def _dispatch(self, layer_name: str, ready: Callable[[], None] | None) -> None:
        layer = self._layers.get(layer_name)
        if layer is None or layer_name in self._dispatched or not self._reqs:
            return  # indexer names ride with their main layer; one dispatch per step
        self._dispatched.add(layer_name)
        last = layer.meta.layer_idx == self._last_layer
        # Per endpoint and the D engine the contacts name: a group whose engine does not answer there fails alone.
        groups: dict[tuple[tuple[str, int], str], tuple[list[ReadReq], list[str], int, int]] = {}
        for r in self._reqs:
            try:
                d_rank, member, ratio = contributor_of(self._tp_rank, self._config.prefill.tp_size, r.d_tp)
                endpoint = (r.d_host, d_endpoint_port(r.d_base_port, d_rank))
                read = self._read_req(r, layer)
            except (BlockIdError, ConfigError) as exc:
                logger.error("sfa request %s: cannot plan layer %s: %s", r.ext_id, layer_name, exc)
                self._dispatcher.resolve(Part(("?", 0), _empty(layer), [], ext_ids=[r.ext_id]), str(exc))
                continue
            if read is None:
                continue
            reads, done, _, _ = groups.setdefault((endpoint, r.d_engine_id), ([], [], member, ratio))
            reads.append(read)
            if last and r.chunk_finish:
                done.append(r.ext_id)
        # Half P's deadline: a read D starts later could not be answered in time anyway.
        budget_ms = int(self._config.read_timeout_s * 500)
        for (endpoint, engine_id), (reads, done, member, ratio) in groups.items():
            msg = ReadReady(
                sender=self._sender,
                layer_idx=layer.meta.layer_idx,
                layer_name=layer_name,
                reads=reads,
                done_ext_ids=done,
                group_member_idx=member,
                tp_ratio=ratio,
                read_budget_ms=budget_ms,
            )
            ext_ids = [q.ext_id for q in reads]
            self._dispatcher.submit(Part(endpoint, msg, list(layer.slots), ready, ext_ids=ext_ids, engine_id=engine_id))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The reuse gate: wait until D answered every read dispatched for this layer's storage.

        Each dispatched read is resolved within ``hello_timeout_s + read_timeout_s`` of being sent
        (then the gate opens and its requests are marked failed), and an endpoint has at most one
        read per layer queued, so the wait is bounded by ``(layers + 1)`` such periods; a D failure
        never stops P. The gate never opens early: D could still be reading.

        Raises:
            TransferError: A send thread died (the worker is broken).
            DeadlineExceeded: The gate stayed closed past every deadline (a bug).
        """
        slots = self._gates.get(layer_name, ())
        c = self._config
        deadline = time.monotonic() + (len(self._layers) + 1) * (c.hello_timeout_s + c.read_timeout_s) + 5.0
        for slot in slots:
            while not slot.event.wait(min(_GATE_LOG_S, max(0.0, deadline - time.monotonic()))):
                if not self._dispatcher.links_alive():
                    raise TransferError(f"sfa send thread stopped; layer {layer_name} cannot be released")
                if time.monotonic() >= deadline:
                    raise DeadlineExceeded(f"sfa reuse gate of {layer_name} still closed after every deadline")
                logger.info("sfa: layer %s still waits for D's read (%d pending)", layer_name, slot.pending)

    def take_failed(self) -> dict[str, str]:
        """Requests whose reads failed since the last call (ext id -> reason), for logs and tests.

        Only the latest `links.FAILURES_KEPT` are kept: vLLM's connector never takes them.
        """
        return self._dispatcher.take_failed()

    def get_finished(self) -> tuple[set[str], set[str]]:
        """P reports nothing: its blocks are freed at once."""
        return set(), set()

    def shutdown(self) -> None:
        """Stop the links (every closed gate opens), then drop the registration."""
        self._dispatcher.shutdown()
        if self._registered is not None:
            self._backend.unregister(self._registered)
            self._registered = None


def _empty(layer: _Layer) -> ReadReady:
    return ReadReady(sender="", layer_idx=layer.meta.layer_idx, layer_name=layer.name, reads=[])
