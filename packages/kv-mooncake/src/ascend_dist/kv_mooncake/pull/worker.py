"""Worker side of the pull connector: registration, P's side-channel server, D's receiver.

Runs in: every worker process (one per TP x PP rank). On P it serves `GetMeta`, `Renew` (answered
per request id) and `Dones` (and a single `Done`) on ``kv_port + device_index`` (bound to the
configured host only; requests up to 64 KiB, every one of these in practice, are answered on the
server's socket thread) and tracks lent blocks with leases (`SendTracker`); on D it runs the
`Receiver`. The engine is injected (any
`Reader`), by default the process-wide Mooncake engine.

With a deployment secret P renews, and counts DONEs, only with a `Grant` it signed for that request
(`core.capability`): other block ids answer "not held" (D reads nothing); other DONEs are ignored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from ascend_dist.common.errors import ConfigError, LayoutError
from ascend_dist.common.log import IntervalLog
from ascend_dist.common.regions import RegisterRegions, collect_storage_merged_register_regions
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.wire import Codec, Handshake
from ascend_dist.common.zmq_server import SMALL_REQUEST_BYTES, RpcServer
from ascend_dist.kv_mooncake.core.affinity import running_on, transfer_cpus
from ascend_dist.kv_mooncake.core.capability import PULL_PURPOSE, CapabilityRefused, Grant, check_grant, wall_ms
from ascend_dist.kv_mooncake.core.engine import Reader, get_engine
from ascend_dist.kv_mooncake.core.kv_geometry import CacheLayout, layout_label
from ascend_dist.kv_mooncake.core.kv_views import layer_axes, state_geometry, tensor_geometry, token_rows
from ascend_dist.kv_mooncake.core.messages import Ack, AgentMetadata, Done, GetMeta, MetaReply, TensorMeta, admit
from ascend_dist.kv_mooncake.core.ports import PortLayout, RankCoord
from ascend_dist.kv_mooncake.core.ranks import PLAN_VERSION
from ascend_dist.kv_mooncake.core.session_owners import session_owners_for
from ascend_dist.kv_mooncake.core.tcp_sockets import process_incarnation
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.cp_plan import cp_layouts, cp_p_fan_in
from ascend_dist.kv_mooncake.pull.messages import (
    CHANNEL,
    Dones,
    Held,
    Renew,
    Reply,
    Request,
    reply_codec,
    request_codec,
)
from ascend_dist.kv_mooncake.pull.sources import source_fan_in, state_source_ranks
from ascend_dist.kv_mooncake.pull.state_bytes import StateLayout
from ascend_dist.kv_mooncake.pull.step_metadata import PullMetadata
from ascend_dist.kv_mooncake.pull.task_batch import LocalCache
from ascend_dist.kv_mooncake.pull.threads import Receiver
from ascend_dist.kv_mooncake.pull.tracker import SendTracker

__all__ = ["KVCaches", "PullWorker", "state_geometry", "tensor_geometry"]  # the geometry lives in kv_views

logger = logging.getLogger(__name__)

KVCaches = Mapping[str, torch.Tensor | Sequence[torch.Tensor]]


def _tensors(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


class PullWorker:
    """The worker half of ``MooncakeConnectorV1``."""

    def __init__(
        self,
        config: PullConfig,
        *,
        tp_rank: int,
        pp_rank: int = 0,
        pcp_rank: int = 0,
        num_kv_heads: int,
        use_mla: bool = False,
        engine: Reader | None = None,
        on_failure: Callable[[BaseException], None] = lambda exc: None,
        secret: DeploymentSecret | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Create the worker (nothing is started until `register_kv_caches`).

        Args:
            config: The connector configuration.
            tp_rank: This worker's tp rank.
            pp_rank: This worker's pp rank (D: always 0).
            pcp_rank: This worker's prefill-context-parallel rank.
            num_kv_heads: Total KV heads of the model (ignored with ``use_mla``).
            use_mla: MLA latent cache (one replicated "head").
            engine: The transfer engine; default the process-wide Mooncake engine.
            on_failure: Called with the error of each of D's failed pull tasks (the connector's stats).
            secret: The deployment secret (P: checks each Renew's and Done's capability; D: checks
                the params' capability before reading); None: nothing is checked (upstream's way).
            wall_clock: Wall seconds for capability expiry (injectable for tests).
        """
        topo = config.prefill if config.is_producer else config.decode
        if not 0 <= tp_rank < topo.tp_size:
            raise ConfigError("tp_rank", tp_rank, f"an int in [0, {topo.tp_size})")
        if not 0 <= pp_rank < topo.pp_size:
            raise ConfigError("pp_rank", pp_rank, f"an int in [0, {topo.pp_size})")
        if not 0 <= pcp_rank < topo.pcp_size:
            raise ConfigError("pcp_rank", pcp_rank, f"an int in [0, {topo.pcp_size})")
        self._pcp_rank = pcp_rank
        self._use_mla = use_mla
        self._config = config
        self._tp_rank = tp_rank
        self._pp_rank = pp_rank
        self._heads = 1 if use_mla else num_kv_heads
        self._engine = engine
        self._on_failure = on_failure
        self._secret = secret
        self._wall_clock = wall_clock
        self._refusals = IntervalLog(10.0, capacity=64)  # forged Renews/DONEs: one line per field per 10 s
        self._regions: RegisterRegions | None = None
        self._server: RpcServer | None = None
        self._receiver: Receiver | None = None
        self._tracker = SendTracker(config.lease_s)
        self._metadata: AgentMetadata | None = None
        self._handshake: Handshake | None = None
        self._requests: Codec[Request] = request_codec(config.max_message_bytes)
        self._replies: Codec[Reply] = reply_codec(config.max_message_bytes)
        self._layout = "mla/NHD" if use_mla else "kv/NHD"  # kind/order; set from the tensors at registration
        self._head_major: dict[str, list[bool]] = {}
        self._axes: dict[str, list[str]] = {}
        self._state_groups: list[int] = []
        self._has_attention = True
        # Seen from the constructing thread: vLLM's forward thread, bound to its OpenMP cores.
        self._transfer_cpus = transfer_cpus()

    @property
    def rank_address(self) -> tuple[str, int] | None:
        """P: ``(host, port)`` of this worker's side channel and Mooncake segment; None on D.

        vLLM hands it to P's scheduler as handshake metadata, which maps each port to its node.
        """
        return (self._config.host, self.handshake_port) if self._config.is_producer else None

    @property
    def handshake_port(self) -> int:
        """The side-channel port of this worker (P binds it)."""
        topo = self._config.prefill if self._config.is_producer else self._config.decode
        layout = PortLayout(
            kv_port=self._config.kv_port,
            tp_size=topo.tp_size,
            pp_size=topo.pp_size,
            pcp_size=topo.pcp_size,
            dp_size=topo.dp_size,
        )
        coord = RankCoord(
            tp_rank=self._tp_rank, pp_rank=self._pp_rank, pcp_rank=self._pcp_rank, dp_rank=self._config.dp_rank
        )
        return layout.port(coord)

    @property
    def tracker(self) -> SendTracker:
        """P's lease tracker."""
        return self._tracker

    @property
    def receiver(self) -> Receiver | None:
        """D's receiver (None on P or before registration)."""
        return self._receiver

    def make_handshake(self, block_size: int, kernel_block_size: int = 0) -> Handshake:
        """This side's handshake: everything P and D must agree on.

        The logical block sizes may differ between P and D (D pairs kernel blocks);
        the kernel block (``kernel_block_size`` tokens, default ``block_size``) must match. With
        context parallelism D may read its blocks as P-sized sub-blocks, so the
        kernel block is left out and every pull checks both sides' block geometry instead.
        """
        c = self._config
        return CHANNEL.handshake(
            sender=f"{c.engine_id}/tp{self._tp_rank}",
            model=c.model,
            dtype=c.dtype,
            # With CP, D may read its blocks as P-sized sub-blocks: each pull checks the geometry.
            **({} if c.uses_cp else {"kernel_block_size": kernel_block_size or block_size}),
            num_kv_heads=self._heads,
            layout=self._layout,
            prefill_tp=c.prefill.tp_size,
            prefill_pp=c.prefill.pp_size,
            decode_tp=c.decode.tp_size,
            cp=f"P{c.prefill.pcp_size}x{c.prefill.dcp_size}/D{c.decode.pcp_size}x{c.decode.dcp_size}",
            plan_version=PLAN_VERSION,
            **({"state_groups": ",".join(map(str, self._state_groups))} if self._state_groups else {}),
        )

    def register_kv_caches(
        self,
        kv_caches: KVCaches,
        *,
        groups: Sequence[Sequence[str]],
        num_blocks: int,
        block_size: int,
        state_groups: Sequence[int] = (),
        state_layout: StateLayout | None = None,
        layout: CacheLayout | None = None,
    ) -> None:
        """Register the KV cache, then start the server (P) or the receiver (D).

        Every thread this starts (the engine's, the server's, the receiver's pool) runs on the
        process's CPUs outside the calling forward thread's binding (`core.affinity`): confined
        to its core they waited behind it under ``vllm serve``, and D's pulls timed out.

        Args:
            kv_caches: Layer name -> tensor or tuple of tensors (K, V, or MLA parts; a state
                layer's conv and ssm tensors).
            groups: Per KV-cache group, its layer names.
            num_blocks: Logical blocks per tensor.
            block_size: Tokens per block.
            state_groups: Indices of the state (Mamba) groups in ``groups``.
            state_layout: D with ``P_tp > D_tp`` and state groups: the conv row's sub-projection
                sizes per P rank.
            layout: The tensors' logical axes and the engine's layout name
                (`kv_views.label_kv_caches`); default vllm-ascend's ``[blocks, tokens, heads, dim]``.

        Raises:
            LayoutError: A tensor's layout is unsupported (the error names the layout).
            ConfigError: A layer of ``groups`` is missing from ``kv_caches``, a state group index
                is out of range, or state groups are combined with context parallelism.
        """
        with running_on(self._transfer_cpus):
            self._register(
                kv_caches,
                groups=groups,
                num_blocks=num_blocks,
                block_size=block_size,
                state_groups=state_groups,
                state_layout=state_layout,
                layout=layout,
            )

    def _register(
        self,
        kv_caches: KVCaches,
        *,
        groups: Sequence[Sequence[str]],
        num_blocks: int,
        block_size: int,
        state_groups: Sequence[int],
        state_layout: StateLayout | None,
        layout: CacheLayout | None,
    ) -> None:
        states = sorted(set(state_groups))
        if any(not 0 <= g < len(groups) for g in states):
            raise ConfigError("state_groups", states, f"group indices in [0, {len(groups)})")
        if states:
            state_source_ranks(0, self._config.prefill.tp_size, self._config.decode.tp_size)  # P_tp = k * D_tp
        state_layers = {n for g in states for n in groups[g]}
        layers = {
            name: [
                state_geometry(name, t, num_blocks)
                if name in state_layers
                else tensor_geometry(name, t, num_blocks, layout)
                for t in _tensors(v)
            ]
            for name, v in kv_caches.items()
        }
        for names in groups:
            for n in names:
                if n not in layers:
                    raise ConfigError("groups", n, f"layer names present in kv_caches ({len(layers)} layers)")
        self._state_groups = states
        self._has_attention = len(states) < len(groups)
        engine = self._engine or get_engine(self._config.host, self._config.protocol)
        self._engine = engine
        self._regions = collect_storage_merged_register_regions([_tensors(v) for v in kv_caches.values()])
        engine.register(self._regions)
        attn_geoms = [geoms[0] for n, geoms in layers.items() if n not in state_layers and geoms]
        label = layout_label(
            layout or CacheLayout(), [g for n, gs in layers.items() if n not in state_layers for g in gs]
        )
        self._layout = f"{'mla' if self._use_mla else 'kv'}/{label}"
        self._head_major = {n: [g.head_major for g in gs] for n, gs in layers.items()}
        self._axes = {n: layer_axes(layout, n, _tensors(v)) for n, v in kv_caches.items()}
        kernels = {g.tokens for g in attn_geoms}
        if len(kernels) > 1 or (kernels and block_size % min(kernels)):
            raise LayoutError("kernel block tokens", sorted(kernels), f"one size dividing block_size={block_size}")
        if kernels and min(kernels) != block_size and self._config.uses_cp:
            raise LayoutError("kernel block tokens", min(kernels), f"= block_size ({block_size}) with CP")
        self._handshake = self.make_handshake(block_size, min(kernels) if kernels else block_size)
        self._tensors = {name: _tensors(v) for name, v in kv_caches.items()}
        if self._config.is_producer:
            self._metadata = AgentMetadata(
                engine_id=self._config.engine_id,
                te_session=engine.session,
                transport_ports=engine.transport_ports,
                incarnation=process_incarnation(),  # a P restarted on these ports says another
                tp_rank=self._tp_rank,
                pp_rank=self._pp_rank,
                block_size=block_size,
                num_blocks=num_blocks,
                layers={
                    n: [
                        TensorMeta(g.base, g.block_len, g.stride, g.tokens, g.heads, g.head_bytes, g.head_major)
                        for g in gs
                    ]
                    for n, gs in layers.items()
                },
            )
            self._server = RpcServer(
                self._config.host,
                self.handshake_port,
                self._handle,
                max_bytes=self._config.max_message_bytes,
                name=f"kv-pull-p{self._pp_rank}.{self._tp_rank}",
                inline=self._answers_inline,
            )
            self._server.start()
        else:
            cache = LocalCache(
                layers, [list(g) for g in groups], block_size, self._heads, frozenset(states), state_layout
            )
            self._receiver = Receiver(
                self._config,
                self._tp_rank,
                cache,
                engine,
                handshake=self._handshake,
                reformat=self._reformat,
                pcp_rank=self._pcp_rank,
                use_mla=self._use_mla,
                on_failure=self._on_failure,
                secret=self._secret,
                wall_clock=self._wall_clock,
                thread_cpus=self._transfer_cpus,
                sessions=session_owners_for(self._config.protocol),
            )

    @staticmethod
    def _answers_inline(payload: bytes) -> bool:
        """Whether the server's socket thread answers ``payload`` at once: every small request.

        Each message takes a lock, a MAC per id and an encode, no I/O; renewals and DONEs sit on D's
        read path, where each hand-off to another thread waits for the GIL. Large frames still go
        through the server's bounded queue (no decode here: the handler decodes once).
        """
        return len(payload) <= SMALL_REQUEST_BYTES

    def _handle(self, payload: bytes) -> bytes:
        """P's side-channel handler (server thread): decode, act, reply."""
        msg = self._requests.decode(payload)
        if isinstance(msg, GetMeta):
            assert self._handshake is not None and self._metadata is not None
            refused = admit(self._handshake, self._config.engine_id, msg)
            return self._replies.encode(refused or MetaReply(handshake=self._handshake, metadata=self._metadata))
        if isinstance(msg, Renew):
            # Each promise is the lease just renewed: a lower bound from this answer on.
            leases = self._renew(msg)
            held = [lease is not None for lease in leases]
            incarnation = self._metadata.incarnation if self._metadata is not None else ""
            return self._replies.encode(
                Held(held=held, lease_s=[lease or 0.0 for lease in leases], incarnation=incarnation)
            )
        # One count per D task (rank, CP rank and shard): a retried copy names the same sender. The
        # answer is the same whether P knew the id, or signed it: not an oracle.
        if isinstance(msg, Dones):
            for item in msg.items:
                if self._secret is None or self._signed(item.request_id, item.grant, expiry=False):
                    self._tracker.done(item.request_id, (msg.d_rank, item.sender), item.reader)
            return self._replies.encode(Ack())
        assert isinstance(msg, Done)
        if self._secret is None or self._signed(msg.request_id, msg.grant, expiry=False):
            self._tracker.done(msg.request_id, (msg.d_rank, msg.sender), msg.reader)
        return self._replies.encode(Ack())

    def _renew(self, msg: Renew) -> list[float | None]:
        """Per request id of ``msg``: None if this rank no longer holds its blocks, else the lease promised.

        Leases are extended (`SendTracker.lease`; 0: still in P's batch, its lease not begun). With
        a secret each id needs its own grant (same order): an id whose grant does not verify is
        answered "not held" and its lease is left alone; lists of different lengths hold nothing.
        """
        n = len(msg.request_ids)
        if self._secret is not None and len(msg.grants) != n:
            return [None] * n
        if any(len(names) not in (0, n) for names in (msg.senders, msg.readers)):
            return [None] * n
        leases: list[float | None] = []
        for i, rid in enumerate(msg.request_ids):
            if self._secret is not None and not self._signed(rid, msg.grants[i], expiry=True):
                leases.append(None)
                continue
            slot = (msg.d_rank, msg.senders[i] if msg.senders else "")
            leases.append(self._tracker.lease(rid, slot, msg.readers[i] if msg.readers else ""))
        return leases

    def _signed(self, request_id: str, grant: Grant | None, *, expiry: bool) -> bool:
        """Whether ``grant`` is ours for ``request_id`` (``expiry``: unexpired too; a DONE may come late)."""
        assert self._secret is not None
        now = wall_ms(self._wall_clock) if expiry else None
        try:
            check_grant(
                self._secret, PULL_PURPOSE, grant, request_id=request_id, engine_id=self._config.engine_id, now_ms=now
            )
        except CapabilityRefused as exc:
            self._refusals.log(
                logger, logging.WARNING, exc.field, "refused a pull Renew/Done for %r: %s", request_id[:64], exc
            )
            return False
        return True

    def _reformat(self, layer: str, block_ids: Sequence[int], pulls: int, sub_tokens: int = 0) -> None:
        """Stacked pulls ``[pull][token][h]`` -> ``[token][pull*h]`` in each listed block.

        Head-major tensors are skipped: P's whole ``[h][token]`` block landed at its heads' offset,
        which is already D's ``[pull*h][token]`` order. ``sub_tokens``: the ids are sub-blocks of
        that many tokens (CP with D's block a multiple of P's); the tensor is then viewed as
        ``[blocks * r, sub_tokens, heads, dim]``.
        """
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        for t, head_major, axes in zip(self._tensors[layer], self._head_major[layer], self._axes[layer], strict=True):
            if head_major:
                continue
            view = token_rows(t, axes)  # token-major: its element order is the physical order
            if sub_tokens:
                view = view.view(-1, sub_tokens, *view.shape[2:])
            _, tokens, heads, dim = view.shape
            blocks = view.index_select(0, idx).reshape(len(block_ids), pulls, tokens, heads // pulls, dim)
            view.index_copy_(0, idx, blocks.transpose(1, 2).reshape(len(block_ids), tokens, heads, dim).contiguous())

    def _fan_in(self, remote_request_id: str) -> int:
        """DONEs this P worker waits for: one per D task reading it (attention and state)."""
        c = self._config
        if not c.uses_cp:
            return source_fan_in(
                self._tp_rank,
                c.prefill.tp_size,
                c.decode.tp_size,
                self._heads,
                remote_request_id,
                attention=self._has_attention,
                state=bool(self._state_groups),
            )
        p_info, d_info = cp_layouts(c, self._use_mla)
        world = self._pcp_rank * c.prefill.tp_size + self._tp_rank
        fan_in = cp_p_fan_in(world, p=p_info, d=d_info, heads=self._heads) if self._has_attention else 0
        if self._state_groups and self._pcp_rank == 0:  # the state is read from P's PCP rank 0 only
            readers = sum(
                self._tp_rank in state_source_ranks(d, c.prefill.tp_size, c.decode.tp_size)
                for d in range(c.decode.tp_size)
            )
            fan_in += readers * c.decode.pcp_size  # every D PCP rank reads its own copy
        return fan_in

    def start_load_kv(self, meta: PullMetadata) -> None:
        """Apply one step's metadata: P tracks lent blocks, D queues pulls."""
        if self._config.is_producer:
            for rid in meta.in_batch:
                self._tracker.add_processing(rid)
            for rid in meta.to_drop:
                self._tracker.drop(rid)
            for rid in meta.to_send:
                fan_in = self._fan_in(rid)
                self._tracker.add_delayed(rid, fan_in)
            return
        if self._receiver is None:
            raise ConfigError("register_kv_caches", "not called", "called before start_load_kv")
        self._receiver.submit_step(meta.requests.values())

    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(finished_sending, finished_recving)`` since the last call."""
        if self._config.is_producer:
            return self._tracker.take_finished(), set()
        return set(), self._receiver.take_finished() if self._receiver else set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """D: logical block ids (every KV group) whose load failed; reported before or with the request."""
        return self._receiver.take_load_errors() if self._receiver else set()

    def take_failed(self, finished: set[str]) -> set[str]:
        """D: which of ``finished`` (from `get_finished`) failed to load, for per-request reporting."""
        return self._receiver.take_failed(finished) if self._receiver else set()

    def shutdown(self) -> None:
        """Stop the server or receiver, then release the registration. Idempotent."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._regions is not None and self._engine is not None:
            self._engine.unregister(self._regions)
            self._regions = None
