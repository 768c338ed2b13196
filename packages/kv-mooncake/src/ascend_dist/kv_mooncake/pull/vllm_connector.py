"""``MooncakeConnectorV1`` for vLLM: a thin `KVConnectorBase_V1` that delegates to this package.

Runs in: vLLM's scheduler process (role SCHEDULER) and each worker process (role WORKER). With `core.vllm_glue`,
the only code of the package that imports vLLM. It translates vLLM objects (``Request``,
``KVCacheBlocks``, ``KVCacheConfig``, the layer -> tensor dict) into plain values and calls
`PullScheduler` / `PullWorker`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.kv_cache_interface import MambaSpec

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import load_secret, warn_unauthenticated
from ascend_dist.kv_mooncake.core.admission import ParamsGate
from ascend_dist.kv_mooncake.core.engine import get_engine
from ascend_dist.kv_mooncake.core.vllm_glue import (
    SchedRequestAdapter,
    StepMetadata,
    connector_config,
    parallel_ranks,
    read_kv_caches,
)
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.messages import TransferParams
from ascend_dist.kv_mooncake.pull.scheduler import PullScheduler
from ascend_dist.kv_mooncake.pull.state_bytes import StateLayout
from ascend_dist.kv_mooncake.pull.step_metadata import PullMetadata
from ascend_dist.kv_mooncake.pull.worker import PullWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["MooncakeConnectorV1", "MooncakeConnectorV1Metadata", "MooncakeHybridConnector", "PullRankAddress"]

logger = logging.getLogger(__name__)


class MooncakeConnectorV1Metadata(StepMetadata[PullMetadata]):
    """vLLM's metadata object carrying this package's `PullMetadata`."""


@dataclass(frozen=True)
class PullRankAddress(KVConnectorHandshakeMetadata):
    """A P worker's side-channel host and port, gathered by vLLM from every worker for P's scheduler.

    The scheduler maps each of P's ports to the node its worker runs on (`PullScheduler.set_rank_addresses`).
    """

    host: str
    port: int


def _state_layout(vllm_config: VllmConfig, spec: MambaSpec | None) -> StateLayout | None:
    """Per-P-rank conv sub-projection sizes (needed only to split a state over ``P_tp > D_tp``).

    ``kv_connector_extra_config.state_conv_segments`` (elements of each sub-projection in one P
    rank's conv row, e.g. Mamba2's ``[x, B, C]``) wins; else GDN's ``[Q, K, V]`` from the HF
    config's ``linear_*`` sizes; else None (a state then transfers only with equal TP).

    Raises:
        ConfigError: ``state_conv_segments`` is not a list of positive ints, or the heads do not
            divide over P's TP.
    """
    if spec is None:
        return None
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {}) if ktc is not None else {}
    elt = spec.dtypes[0].itemsize
    raw = extra.get("state_conv_segments")
    if raw is not None:
        if (
            not isinstance(raw, list | tuple)
            or not raw
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in raw)
        ):
            raise ConfigError("kv_connector_extra_config.state_conv_segments", raw, "a list of positive ints")
        return StateLayout(tuple(raw), elt)
    hf = vllm_config.model_config.hf_text_config
    names = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim")
    values = [getattr(hf, n, None) for n in names]
    if any(not isinstance(v, int) for v in values):
        return None
    nk, dk, nv, dv = (int(v) for v in values)  # type: ignore[arg-type]
    p_tp = int(extra.get("prefill", {}).get("tp_size", 1))
    if nk % p_tp or nv % p_tp:
        raise ConfigError("prefill.tp_size", p_tp, f"a divisor of the linear-attention heads ({nk}, {nv})")
    return StateLayout.gdn(nk // p_tp * dk, nv // p_tp * dv, elt)


def _truncate_prompt(request: Request) -> None:
    """Mirror `PullScheduler.truncate_for_state` on vLLM's request: drop the last prompt token."""
    if request.prompt_token_ids is not None:
        request.prompt_token_ids.pop()
    elif request.prompt_embeds is not None:
        request.prompt_embeds = request.prompt_embeds[:-1]
    request._all_token_ids.pop()
    request.num_prompt_tokens -= 1
    request.max_tokens = 1


class MooncakeConnectorV1(SchedRequestAdapter[PullScheduler, PullWorker]):
    """P/D disaggregation: D pulls the prompt's KV cache from P over Mooncake (vllm-ascend's name)."""

    _bind_flag = "do_remote_prefill"  # P binds the params it hands out to its prompt

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        """Build the scheduler or worker half from vLLM's configuration.

        Raises:
            ConfigError: The kv_transfer_config is invalid; the error names the field.
        """
        super().__init__(vllm_config, role, kv_cache_config)
        assert kv_cache_config is not None  # the base refused None
        self._pull_config = connector_config(vllm_config, type(self).__name__, PullConfig.from_kv_transfer_config)
        groups = kv_cache_config.kv_cache_groups
        self._state_groups = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
        attn = [i for i in range(len(groups)) if i not in self._state_groups]
        self._block_size = self._block_sizes[attn[0]] if attn else self._block_sizes[0]
        mamba = [g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
        self._state_layout = _state_layout(vllm_config, mamba[0] if mamba else None)
        secret = load_secret()  # P signs its params, D and P check them (`core.capability`)
        if secret is None:
            warn_unauthenticated(type(self).__name__)
        if role == KVConnectorRole.SCHEDULER:
            windows = [
                math.ceil(w / bs) + 1 if (w := getattr(g.kv_cache_spec, "sliding_window", None)) else 0
                for g, bs in zip(groups, self._block_sizes, strict=True)
            ]
            self._scheduler = PullScheduler(
                self._pull_config,
                self._block_sizes,
                windows,
                state_groups=self._state_groups,
                num_speculative_tokens=max((m.num_speculative_blocks for m in mamba), default=0),
                secret=secret,
            )
            self._gate = ParamsGate(type(self).__name__, self._scheduler.check_params, TransferParams.__struct_fields__)
        else:
            model = vllm_config.model_config
            cfg = self._pull_config
            tp_rank, pp_rank, pcp_rank = parallel_ranks()
            self._worker = PullWorker(
                self._pull_config,
                tp_rank=tp_rank,
                pp_rank=pp_rank,
                pcp_rank=pcp_rank,
                num_kv_heads=model.get_total_num_kv_heads(),
                use_mla=bool(model.use_mla),
                engine=(engine := self.counting_engine(lambda: get_engine(cfg.host, cfg.protocol))),
                on_failure=engine.failure_sink("load"),
                secret=secret,
            )

    # ---- scheduler side -------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Admit the request's kv_transfer_params (see `ParamsGate`); P with state groups truncates.

        The truncation is here, not in `update_state_after_alloc`: vLLM sizes the first chunk
        (``num_tokens - computed``) and allocates before that hook, and it calls this one once per
        request when the request is added (0.32 and 0.33), where side effects are allowed.
        """
        if self._scheduler is not None and self._scheduler.truncate_for_state(self._admitted(request)):
            _truncate_prompt(request)

    # get_num_new_matched_tokens (the base's pure query): P's truncation happened in `on_new_request`;
    # D's pull is recorded by `update_state_after_alloc`.

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Record the pull into the freshly allocated (unhashed) blocks."""
        local = blocks.get_unhashed_block_ids_all_groups() if num_external_tokens > 0 else []
        self._sched().update_state_after_alloc(self._admitted(request), local, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's pulls and delayed frees."""
        return MooncakeConnectorV1Metadata(self._sched().build_connector_meta())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Single-group form of `request_finished_all_groups`."""
        return self._sched().request_finished(self._admitted(request, digest=True), [block_ids])

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Delayed free and P's kv_transfer_params; a rejected request is freed at once."""
        return self._sched().request_finished(self._admitted(request, digest=True), list(block_ids))

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Accept every (pp_rank, tp_rank) worker, PP stages > 0 included (PP on P is supported).

        vLLM's default refuses ``pp_rank > 0``. P's scheduler keeps where each worker listens (its
        `PullRankAddress`), so the params name each rank's node when the instance spans nodes; D
        fetches each P worker's metadata over the side channel from there and checks its rank.
        """
        self.set_xfer_handshake_metadata(dict(enumerate(metadata.values())))

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Record each P worker's `PullRankAddress` (the rank keys are not needed: the port says it)."""
        addresses = [(m.host, m.port) for m in metadata.values() if isinstance(m, PullRankAddress)]
        logger.debug("handshake metadata of %d workers: %s", len(metadata), addresses)
        self._sched().set_rank_addresses(addresses)

    def get_handshake_metadata(self) -> PullRankAddress | None:
        """P's worker: where its side channel and Mooncake segment live (None on D)."""
        address = self._work().rank_address
        return PullRankAddress(*address) if address is not None else None

    # ---- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's caches: ``[B, H, N, C]`` views (vLLM >= 0.32), split K/V, or MLA tensors.

        Raises:
            LayoutError: A tensor's layout cannot be served (e.g. vLLM's ``LHBNC``); names the layout.
        """
        parts, layout = read_kv_caches(kv_caches, self._vllm_config)
        groups = [[n for n in g if n in parts] for g in self._groups]
        self._work().register_kv_caches(
            parts,
            groups=groups,
            num_blocks=self._num_blocks,
            block_size=self._block_size,
            state_groups=self._state_groups,
            state_layout=self._state_layout,
            layout=layout,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Queue D's pulls / record P's lent blocks for the bound metadata."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, MooncakeConnectorV1Metadata):
            raise ConfigError("connector_metadata", type(meta).__name__, "MooncakeConnectorV1Metadata")
        self._work().start_load_kv(meta.inner)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole-prompt pull: loads complete between steps, nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """P does not push; D pulls after P finished."""

    def wait_for_save(self) -> None:
        """Nothing is saved synchronously."""

    # get_finished / get_transfer_results / get_block_ids_with_load_errors / shutdown: the base's.

    def _failed_recving(self, recving: set[str] | None) -> set[str]:
        return self._work().take_failed(recving) if recving else set()


class MooncakeHybridConnector(MooncakeConnectorV1):
    """vllm-ascend's ``MooncakeHybridConnector`` name, served by the whole-prompt pull planner.

    Upstream this is an older pull variant (flat metadata, no CP); the name is mapped
    to the current planner, which handles what it was for: attention plus state (Mamba/GDN)
    groups, sliding-window groups, heterogeneous TP and PP on P. Differences that remain against
    the legacy connector: the wire format is this package's (the handshake refuses a legacy peer),
    prefixes are skipped by D's prefix hit (tail alignment only for sliding-window groups),
    failures are reported as load errors of every group, and context parallelism is accepted (the
    legacy connector asserted it off).
    """
