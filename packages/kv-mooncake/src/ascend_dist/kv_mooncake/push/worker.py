"""Worker side of the layer-wise push: registration, P's per-layer save path, D's side-channel server.

Runs in: every worker process (one per TP x PCP rank). Order of calls (vLLM v1 model runner):
``register_kv_caches`` once; per step ``start_load_kv`` -> per layer ``wait_for_layer_load`` ->
(attention writes the layer's KV) -> ``save_kv_layer`` -> ``wait_for_save`` -> ``get_finished`` /
``get_block_ids_with_load_errors``; ``shutdown`` at exit.

* **D** binds its ROUTER at ``kv_port + dp·pcp·tp + pcp_rank·tp + tp_rank`` (host only), answers
  `GetMeta` with its block addresses and records `LayerDone` / `PushDone` in a `LayerReceiver`.
* **P** waits at ``start_load_kv`` until the previous steps' pushes have read their blocks (vLLM
  writes a layer's KV before ``wait_for_layer_load``, so the per-layer gate alone comes too late for
  reallocated blocks), plans each request's writes (fetching D's metadata once per endpoint),
  and at each ``save_kv_layer`` closes the layer's reuse gate and queues the layer to the
  `SendThread`, so the push of layer ``i`` overlaps the compute of layer ``i+1``. With
  ``pd_head_ratio > 1`` it first gathers the layer's blocks and runs the all-to-all (`reshard`) into
  a registered staging slot. ``wait_for_layer_load`` on P is the reuse gate.
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence

import torch

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.common.regions import RegisterRegions, collect_storage_merged_register_regions
from ascend_dist.common.timeouts import transfer_timeout_ms
from ascend_dist.common.wire import Handshake
from ascend_dist.common.zmq_rpc import RpcClient
from ascend_dist.common.zmq_server import RpcServer
from ascend_dist.kv_mooncake.core.blocks import TensorGeom
from ascend_dist.kv_mooncake.core.descriptors import Descriptors
from ascend_dist.kv_mooncake.core.device_fence import Fence
from ascend_dist.kv_mooncake.core.engine import Writer, get_engine
from ascend_dist.kv_mooncake.core.kv_geometry import CacheLayout, layout_label
from ascend_dist.kv_mooncake.core.kv_views import layer_axes, tensor_geometry, token_rows
from ascend_dist.kv_mooncake.core.messages import Ack, AgentMetadata, GetMeta, MetaReply, TensorMeta, admit
from ascend_dist.kv_mooncake.core.session_owners import session_owners_for
from ascend_dist.kv_mooncake.push.config import LayerwiseConfig
from ascend_dist.kv_mooncake.push.gate import ReuseGate
from ascend_dist.kv_mooncake.push.messages import CHANNEL, Claim, LayerDone, PushDone, reply_codec, request_codec
from ascend_dist.kv_mooncake.push.producer import STAGING_SLOTS, LayerTable, Producer
from ascend_dist.kv_mooncake.push.receiver import LayerReceiver
from ascend_dist.kv_mooncake.push.reshard import AllToAll
from ascend_dist.kv_mooncake.push.sender import MetaCache, SendThread
from ascend_dist.kv_mooncake.push.step_metadata import LayerwiseMetadata

__all__ = ["LayerwiseWorker"]

logger = logging.getLogger(__name__)

FAILURE_REASONS_KEPT = 32  # D: the latest failed requests' reasons (each is logged when it fails)


def _tensors(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


class LayerwiseWorker:
    """The worker half of ``MooncakeLayerwiseConnector``."""

    def __init__(
        self,
        config: LayerwiseConfig,
        *,
        tp_rank: int,
        pcp_rank: int = 0,
        num_kv_heads: int,
        use_mla: bool = False,
        engine: Writer | None = None,
        all_to_all: AllToAll | None = None,
    ) -> None:
        """Create the worker (nothing starts before `register_kv_caches`).

        Args:
            config: The connector configuration.
            tp_rank: This worker's TP rank.
            pcp_rank: This worker's PCP rank.
            num_kv_heads: Total KV heads of the model (ignored with ``use_mla``).
            use_mla: MLA latent cache (one replicated "head").
            engine: The push engine; default the process-wide Mooncake engine.
            all_to_all: P with ``pd_head_ratio > 1``: the exchange over the P ranks feeding one D rank.

        Raises:
            ConfigError: A rank is out of range, or resharding is needed without ``all_to_all``.
        """
        topo = config.prefill if config.is_producer else config.decode
        if not 0 <= tp_rank < topo.tp_size:
            raise ConfigError("tp_rank", tp_rank, f"an int in [0, {topo.tp_size})")
        if not 0 <= pcp_rank < topo.pcp_size:
            raise ConfigError("pcp_rank", pcp_rank, f"an int in [0, {topo.pcp_size})")
        self._config, self._tp_rank, self._pcp_rank = config, tp_rank, pcp_rank
        self._heads = 1 if use_mla else num_kv_heads
        self._use_mla = use_mla
        self._p, self._d = config.parallel_infos(self._heads, use_mla)
        self._ratio = self._p.pd_head_ratio
        if config.is_producer and self._ratio > 1 and (all_to_all is None or all_to_all.size != self._ratio):
            raise ConfigError("all_to_all", all_to_all, f"an all-to-all group of size pd_head_ratio={self._ratio}")
        self._a2a = all_to_all
        self._engine = engine
        self._requests = request_codec(config.max_message_bytes)
        self._replies = reply_codec(config.max_message_bytes)
        self._names: list[str] = []
        self._table = LayerTable((), {}, {}, {}, 1)
        self._group_of: dict[str, int] = {}
        self._tensors: dict[str, list[torch.Tensor]] = {}
        self._metas: dict[str, list[TensorMeta]] = {}
        self._regions: list[RegisterRegions] = []
        self._server: RpcServer | None = None
        self._receiver: LayerReceiver | None = None
        self._producer: Producer | None = None
        self._client: RpcClient | None = None
        self._handshake: Handshake | None = None
        self._agent: AgentMetadata | None = None
        self._load_errors: set[int] = set()
        self._failed_rids: set[str] = set()
        # The latest failures' reasons (tests, diagnostics); bounded: vLLM never collects them.
        self.failure_reasons: OrderedDict[str, str] = OrderedDict()
        self._layout = "mla/NHD" if use_mla else "kv/NHD"  # kind/order; set from the tensors at registration

    @property
    def handshake_port(self) -> int:
        """The port a D worker binds."""
        return self._config.d_port(self._tp_rank, self._pcp_rank)

    @property
    def receiver(self) -> LayerReceiver | None:
        """D's receiver (None on P or before registration)."""
        return self._receiver

    @property
    def layer_names(self) -> list[str]:
        """Registered layers in index order."""
        return list(self._names)

    def make_handshake(self, block_size: int) -> Handshake:
        """This side's handshake: everything P and D must agree on."""
        c = self._config
        return CHANNEL.handshake(
            sender=f"{c.engine_id}/tp{self._tp_rank}",
            model=c.model,
            dtype=c.dtype,
            block_size=block_size,
            num_kv_heads=self._heads,
            num_layers=len(self._names),
            layout=self._layout,
            prefill_tp=c.prefill.tp_size,
            decode_tp=c.decode.tp_size,
            cp=f"P{c.prefill.pcp_size}x{c.prefill.dcp_size}/D{c.decode.pcp_size}x{c.decode.dcp_size}",
        )

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        *,
        groups: Sequence[Sequence[str]],
        num_blocks: int,
        block_size: int,
        layout: CacheLayout | None = None,
    ) -> None:
        """Register the KV cache, then start D's server or P's send thread.

        Args:
            kv_caches: Layer name -> tensor or tuple (K, V, or MLA parts), in layer order.
            groups: Per KV-cache group, its layer names.
            num_blocks: Logical blocks per tensor.
            block_size: Tokens per block.
            layout: The tensors' logical axes and the engine's layout name
                (`kv_views.label_kv_caches`); default vllm-ascend's ``[blocks, tokens, heads, dim]``.

        Raises:
            LayoutError: A tensor's layout is unsupported (the error names the layout), or a layer
                mixes token- and head-major tensors.
            ConfigError: A layer is in no group.
        """
        self._names = list(kv_caches)
        self._group_of = {n: g for g, names in enumerate(groups) for n in names}
        for n in self._names:
            if n not in self._group_of:
                raise ConfigError("groups", n, "every layer of kv_caches in one KV-cache group")
        self._tensors = {n: _tensors(v) for n, v in kv_caches.items()}
        geoms = {n: [tensor_geometry(n, t, num_blocks, layout) for t in ts] for n, ts in self._tensors.items()}
        for n, gs in geoms.items():
            if len({g.head_major for g in gs}) > 1:
                raise LayoutError(f"{n} block order", "mixed", "one order (token- or head-major) per layer")
        self._metas = {n: [TensorMeta(*_geom(g)) for g in gs] for n, gs in geoms.items()}
        label = layout_label(layout or CacheLayout(), [g for gs in geoms.values() for g in gs])
        self._layout = f"{'mla' if self._use_mla else 'kv'}/{label}"
        # P's all-to-all gathers token rows: ``[blocks, tokens, heads, dim]`` views, any storage order.
        rows = {
            n: [token_rows(t, a) for t, a in zip(ts, layer_axes(layout, n, ts), strict=True)]
            for n, ts in self._tensors.items()
        }
        engine = self._engine or get_engine(self._config.host, self._config.protocol)
        self._engine = engine
        self._register(collect_storage_merged_register_regions(list(self._tensors.values())))
        self._handshake = self.make_handshake(block_size)
        self._block_size, self._num_blocks = block_size, num_blocks
        self._table = LayerTable(self._names, self._group_of, rows, self._metas, block_size)
        if self._config.is_producer:
            self._start_producer(engine)
        else:
            self._start_consumer(engine)

    def _register(self, regions: RegisterRegions) -> None:
        assert self._engine is not None
        self._engine.register(regions)
        self._regions.append(regions)

    def _start_consumer(self, engine: Writer) -> None:
        c = self._config
        self._agent = AgentMetadata(
            engine_id=c.engine_id,
            te_session=engine.session,
            tp_rank=self._tp_rank,
            block_size=self._block_size,
            num_blocks=self._num_blocks,
            layers=self._metas,
            # P checks them against the session's first owner (P's Mooncake keeps a descriptor per session).
            transport_ports=engine.transport_ports,
            # Named in each answer to a Claim: P writing with a dead worker's metadata (a D restarted
            # on these ports, its engine id pinned) would write at the dead worker's addresses.
            incarnation=secrets.token_hex(8),
        )
        self._receiver = LayerReceiver(
            len(self._names),
            first_layer_timeout_s=c.first_layer_timeout_s,
            layer_timeout_s=c.layer_timeout_s,
            fence_timeout_s=c.fence_timeout_s,
        )
        self._server = RpcServer(
            c.host, self.handshake_port, self._handle, max_bytes=c.max_message_bytes, name=f"kv-lw-d{self._tp_rank}"
        )
        self._server.start()

    def _start_producer(self, engine: Writer) -> None:
        c = self._config
        assert self._handshake is not None
        self._client = client = RpcClient(
            timeout_s=c.rpc_timeout_s, retries=c.rpc_retries, max_reply_bytes=c.max_message_bytes
        )
        sessions = session_owners_for(c.protocol)
        metas = MetaCache(client, self._requests, self._replies, self._handshake, c.engine_id, sessions=sessions)

        def make_sender(gate: ReuseGate) -> SendThread:
            return SendThread(
                engine,
                client=client,
                requests=self._requests,
                replies=self._replies,
                gate=gate,
                metas=metas,
                sender=f"{engine.session}/tp{self._tp_rank}.pcp{self._pcp_rank}",
                transfer_timeout_s=transfer_timeout_ms() / 1000.0,
                # One step's layers at most: start_load_kv waits for every queued layer before the
                # next forward; with resharding the staging slots bound it tighter.
                queue_size=len(self._table.names) if self._p.pd_head_ratio == 1 else STAGING_SLOTS,
                # D holds a request it gave up on fence_timeout_s after the latest claim (P's and D's
                # values should match): a write needs a claim younger than half of it.
                claim_ttl_s=c.fence_timeout_s / 2,
            )

        self._producer = Producer(
            c,
            self._table,
            tp_rank=self._tp_rank,
            pcp_rank=self._pcp_rank,
            heads=self._heads,
            use_mla=self._use_mla,
            p=self._p,
            all_to_all=self._a2a,
            metas=metas,
            make_sender=make_sender,
            register=self._register,
        )

    def _handle(self, payload: bytes) -> bytes:
        """D's side-channel handler (server thread): decode, record, reply."""
        msg = self._requests.decode(payload)
        assert self._receiver is not None and self._handshake is not None and self._agent is not None
        if isinstance(msg, GetMeta):
            refused = admit(self._handshake, self._config.engine_id, msg)
            return self._replies.encode(refused or MetaReply(handshake=self._handshake, metadata=self._agent))
        if isinstance(msg, Claim):
            unknown = self._receiver.on_claim(msg.sender, msg.request_ids)
            return self._replies.encode(Ack(unknown=unknown, incarnation=self._agent.incarnation))
        if isinstance(msg, LayerDone):
            return self._replies.encode(Ack(unknown=self._receiver.on_layer_done(msg)))
        assert isinstance(msg, PushDone)
        known = self._receiver.on_done(msg)
        return self._replies.encode(Ack(unknown=[] if known else [msg.request_id]))

    def start_load_kv(self, meta: LayerwiseMetadata) -> None:
        """Apply one step's metadata: D starts waiting; P waits for earlier pushes, then plans this step's writes.

        Raises:
            ConfigError: Called before `register_kv_caches`.
            DeadlineExceeded: P: an earlier layer was still being pushed after ``gate_timeout_s``.
            TransferError: P: the send thread died with layers queued.
        """
        if not self._names:
            raise ConfigError("register_kv_caches", "not called", "called before start_load_kv")
        if self._receiver is not None:
            for r in meta.recv:
                self._receiver.expect(r)
            return
        assert self._producer is not None
        self._producer.plan_step(meta.send, meta.ended)

    def wait_for_layer_load(self, layer_name: str, request_ids: Collection[str] = ()) -> None:
        """P: wait until the layer's storage is no longer being pushed; D: wait for the listed requests' layer.

        Raises:
            DeadlineExceeded: The layer did not become ready in time.
            TransferError: P's send thread died.
        """
        idx = self._table.index(layer_name)
        if self._producer is not None:
            error = self._producer.gate.wait_for_layer_reuse(idx, self._config.gate_timeout_s)
            if error:
                logger.debug("layer %s: the previous push failed: %s", layer_name, error)
        elif self._receiver is not None and request_ids:
            self._receiver.wait_layer(idx, request_ids, self._config.layer_timeout_s)

    def save_kv_layer(self, layer_name: str, fence: Fence | None = None) -> None:
        """P: queue the layer's writes for this step's requests; D: no-op.

        ``fence`` (on a device) is called once the layer's work on the compute stream is enqueued
        (after resharding); the send thread waits for what it returns before reading the cache.

        Raises:
            DeadlineExceeded: No staging slot became free within ``gate_timeout_s`` (resharding).
            TransferError: The send thread is not running.
        """
        if self._producer is not None:
            self._producer.save_kv_layer(layer_name, fence)

    def layer_batches(self, layer_name: str) -> list[tuple[str, Descriptors]]:
        """P: the plain-path writes of one layer for this step, per D session (the bench's raw baseline)."""
        if self._producer is None:
            raise ConfigError("role", "kv_consumer", "kv_producer for layer_batches")
        return self._producer.layer_batches(layer_name)

    def wait_for_save(self) -> None:
        """Saves are asynchronous: the reuse gate orders storage reuse, nothing to wait for here."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)``; D's failed requests are in ``finished_recving`` too."""
        if self._receiver is None:
            return set(), set()
        done, errors, reasons = self._receiver.take_finished()
        self._load_errors |= errors
        self._failed_rids |= set(reasons)
        self.failure_reasons.update(reasons)
        while len(self.failure_reasons) > FAILURE_REASONS_KEPT:
            self.failure_reasons.popitem(last=False)
        return set(), done

    def take_failed(self) -> set[str]:
        """D: the requests `get_finished` just reported that failed (vLLM's per-request report)."""
        out, self._failed_rids = self._failed_rids, set()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """D: logical block ids (every group) of the requests `get_finished` just reported failed.

        vLLM calls it right after ``get_finished`` in the same step, so a failed request and its
        blocks reach the scheduler together.
        """
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        """Stop the send thread or server, then release registrations. Idempotent."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._engine is not None:
            for regions in self._regions:
                self._engine.unregister(regions)
        self._regions = []


def _geom(g: TensorGeom) -> tuple[int, int, int, int, int, int, bool]:
    return (g.base, g.block_len, g.stride, g.tokens, g.heads, g.head_bytes, g.head_major)
