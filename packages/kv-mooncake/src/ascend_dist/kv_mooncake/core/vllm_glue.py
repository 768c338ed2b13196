"""vLLM glue shared by the three adapters (`vllm_connector`, `layerwise.vllm_connector`, `sfa.vllm_connector`).

Runs in: vLLM's scheduler and worker processes. An adapter module (it imports vLLM and torch): it
reads the ``kv_transfer_config`` into a connector's config, finds this worker's parallel ranks,
splits vLLM's per-layer caches into the tensors the workers register (labelled with their logical
axes and vLLM's resolved KV-cache layout, `read_kv_caches`), and applies one rule to how D's
failed loads reach vLLM.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Mapping
from pathlib import PurePath
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.vllm_stats import TransferStatsReporting
from ascend_dist.kv_mooncake.core.admission import ParamsGate, Preview
from ascend_dist.kv_mooncake.core.kv_geometry import CacheLayout
from ascend_dist.kv_mooncake.core.kv_views import label_kv_caches
from ascend_dist.kv_mooncake.core.messages import prompt_digest
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.core.stats_engine import CountingEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = [
    "MooncakeAdapterBase",
    "SchedRequestAdapter",
    "StepMetadata",
    "sched_request",
    "block_load_errors",
    "connector_config",
    "kv_cache_layout_name",
    "admit_bound",
    "model_name",
    "prompt_binding_error",
    "request_prompt_digest",
    "parallel_ranks",
    "read_kv_caches",
    "split_kv_caches",
    "transfer_results",
]

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")
InnerT = TypeVar("InnerT")
SchedT = TypeVar("SchedT", bound="_Scheduler")
WorkT = TypeVar("WorkT", bound="_Worker")


class StepMetadata(KVConnectorMetadata, Generic[InnerT]):
    """vLLM's metadata object carrying one step's metadata of a transport (``inner``)."""

    def __init__(self, inner: InnerT) -> None:
        """Wrap one step's metadata."""
        self.inner = inner


def sched_request(request: Request, *, digest: bool = False) -> SchedRequest:
    """The request as the pull and push schedulers see it.

    ``digest``: also hash the prompt (only what hands out or announces params needs it).
    """
    return SchedRequest(
        request_id=request.request_id,
        prompt_len=request.num_prompt_tokens,
        kv_transfer_params=request.kv_transfer_params,
        length_capped=request.status == RequestStatus.FINISHED_LENGTH_CAPPED,
        prompt_digest=request_prompt_digest(request) if digest else None,
    )


def connector_config(vllm_config: VllmConfig, connector: str, parse: Callable[..., ConfigT]) -> ConfigT:
    """Parse the ``kv_transfer_config`` with a config's ``from_kv_transfer_config``.

    ``dp_rank`` defaults to vLLM's data-parallel rank; ``dtype`` is the cache dtype, or the
    model's when it is ``auto``.

    Raises:
        ConfigError: The ``kv_transfer_config`` is missing or invalid; the error names the field.
    """
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ConfigError("kv_transfer_config", None, f"set ({connector} needs kv_role, kv_port, engine_id)")
    extra = dict(ktc.kv_connector_extra_config or {})
    extra.setdefault("dp_rank", vllm_config.parallel_config.data_parallel_rank)
    cache_dtype = vllm_config.cache_config.cache_dtype
    return parse(
        engine_id=ktc.engine_id,
        kv_role=ktc.kv_role,
        kv_port=ktc.kv_port,
        extra=extra,
        model=model_name(vllm_config),
        dtype=str(cache_dtype if cache_dtype != "auto" else vllm_config.model_config.dtype),
    )


def model_name(vllm_config: VllmConfig) -> str:
    """The model's name as P and D compare it at the handshake: the served name, else the model.

    A local path counts by its last component: P and D on different machines mount the same
    checkpoint at different paths, and what must match is the model, not the mount point.
    """
    model = vllm_config.model_config
    served = getattr(model, "served_model_name", None)
    name = str((served[0] if isinstance(served, list | tuple) and served else served) or model.model)
    return PurePath(name).name if name.startswith(("/", ".")) else name


def parallel_ranks() -> tuple[int, int, int]:
    """``(tp_rank, pp_rank, pcp_rank)`` of this worker; zeros when vLLM's parallel groups are not initialised."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 0, 0
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pp_group().rank_in_group,
        parallel_state.get_pcp_group().rank_in_group,
    )


def _native_views() -> bool:
    """Whether this vLLM hands connectors its own ``[B, H, N, C]`` per-layer views (vLLM >= 0.32)."""
    try:
        return importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None
    except (ImportError, ValueError):
        return False


def kv_cache_layout_name(vllm_config: VllmConfig) -> str:
    """VLLM's resolved physical KV-cache layout (``"LBHNC"``, ...); ``""`` before vLLM 0.32 or unresolved."""
    name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    return str(name) if name else ""


def read_kv_caches(
    kv_caches: Mapping[str, Any], vllm_config: VllmConfig
) -> tuple[dict[str, list[torch.Tensor]], CacheLayout]:
    """Split vLLM's layer -> cache dict into tensors per layer, labelled with their logical axes.

    vLLM >= 0.32 hands one ``[B, H, N, C]`` view per attention layer (physical order: the
    resolved ``cache_config.kv_cache_layout``); a legacy ``[2, blocks, ...]`` tensor is split into
    K and V (``[B, N, H, D]``, any stride order); tuples (vllm-ascend's K/V or nope/rope, Mamba's
    states) are taken as they are (see `kv_views.label_kv_caches`). The workers then read each
    tensor's block geometry from its strides.
    """
    native = _native_views()
    parts, layout = label_kv_caches(kv_caches, native=native, layout_name=kv_cache_layout_name(vllm_config))
    logger.info("KV caches of %d layers, layout %s", len(parts), layout.name or "from strides")
    return parts, layout


def split_kv_caches(kv_caches: Mapping[str, Any]) -> dict[str, list[torch.Tensor]]:
    """`read_kv_caches` without vLLM's layout: legacy ``[2, blocks, ...]`` split, everything else as given."""
    return label_kv_caches(kv_caches)[0]


# How D's failed loads reach vLLM 0.33. Block ids repeat across KV-cache groups, so for a model with
# several groups vLLM raises on block-level reports and wants failed requests instead; with one
# group block ids say more (vLLM recomputes from the first bad block, not from the start).


def transfer_results(
    sending: set[str] | None, recving: set[str] | None, failed: set[str], num_groups: int
) -> KVConnectorTransferResults:
    """VLLM's per-step report: ``failed`` (already in ``recving``) is passed on only with several groups."""
    return KVConnectorTransferResults(
        finished_sending=set(sending or ()),
        finished_recving=set(recving or ()),
        failed_recving=failed if num_groups > 1 else set(),
    )


def block_load_errors(errors: set[int], num_groups: int) -> set[int]:
    """The failed block ids vLLM may be given: all of them with one group, none with several."""
    return errors if num_groups == 1 else set()


# Prompt binding. The side that computes a prompt's KV (P in a pull, D announcing its blocks in a
# push) puts the digest of that prompt in the params it hands out; the side acting on them acts only
# for the same prompt. Params replayed onto another prompt, or copied from another client's request,
# would otherwise decode (pull) or overwrite (push) that other request's KV.


def request_prompt_digest(request: Request) -> str | None:
    """`messages.prompt_digest` of the request's prompt (None for prompt embeddings)."""
    tokens = request.prompt_token_ids
    return prompt_digest(tokens[: request.num_prompt_tokens]) if tokens is not None else None


def prompt_binding_error(request: Request, flag: str) -> ConfigError | None:
    """Whether params carrying ``flag`` are bound to this request's prompt (None: they are, or no flag).

    ``remote_prompt_tokens`` may be one less than the prompt: P drops the last token for state groups.
    """
    raw = request.kv_transfer_params
    tokens = request.prompt_token_ids
    if not isinstance(raw, dict) or raw.get(flag) is not True or tokens is None:
        return None
    n, digest = raw.get("remote_prompt_tokens"), raw.get("remote_prompt_digest")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= request.num_prompt_tokens:
        return ConfigError("kv_transfer_params.remote_prompt_tokens", Preview(n), "the prompt length of its sender")
    if not isinstance(digest, str) or digest != prompt_digest(tokens[:n]):
        return ConfigError(
            "kv_transfer_params.remote_prompt_digest", Preview(digest), "the digest of this request's prompt"
        )
    return None


def admit_bound(gate: ParamsGate, request: Request, flag: str) -> bool:
    """`ParamsGate.admit`, then the prompt binding of well-formed params (dropped, one warning, if unbound)."""
    if not gate.admit(request, request.num_prompt_tokens):
        return False
    error = prompt_binding_error(request, flag)
    if error is None:
        return True
    gate.drop(request, error)
    return False


# The adapters' shared skeleton. Each adapter keeps vLLM's hooks that differ (planning, cache
# registration, step start); what is the same in all of them (the constructor's opening, the role
# guards, how a worker's results become vLLM's report) lives here once.


class _Scheduler(Protocol):
    def get_num_new_matched_tokens(self, request: SchedRequest, num_computed_tokens: int) -> tuple[int, bool]: ...


class _Worker(Protocol):
    def get_finished(self) -> tuple[set[str], set[str]]: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def shutdown(self) -> None: ...


class MooncakeAdapterBase(TransferStatsReporting, KVConnectorBase_V1, SupportsHMA):
    """What every kv-mooncake adapter shares: the `KVCacheConfig` check, the gate slot, the result report, the stats.

    Stats (`TransferStatsReporting`, channel ``p2p``): the workers' engine is a
    `core.stats_engine.CountingEngine` around the process-wide one (`counting_engine`), so each
    engine batch call is one transfer in vLLM's ``vllm:mooncake_*`` metrics.

    Subclasses say where D's failed requests and failed blocks come from (`_failed_recving`,
    `_load_error_blocks`); `get_transfer_results` and `get_block_ids_with_load_errors` then apply
    `transfer_results` / `block_load_errors` with this model's number of KV-cache groups.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        """Read the KV-cache groups' block sizes and layer names from vLLM's `KVCacheConfig`.

        Raises:
            ConfigError: ``kv_cache_config`` is missing (vLLM before 0.11).
        """
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        if kv_cache_config is None:
            raise ConfigError("kv_cache_config", None, "vLLM's KVCacheConfig (vLLM >= 0.11 passes it)")
        groups = kv_cache_config.kv_cache_groups
        self._block_sizes = [g.kv_cache_spec.block_size for g in groups]
        self._groups = [list(g.layer_names) for g in groups]  # layer names of each KV-cache group
        self._num_blocks = kv_cache_config.num_blocks
        self._num_groups = len(groups)
        self._gate: ParamsGate | None = None  # set by the scheduler role

    stats_channels = ("p2p",)

    def counting_engine(self, make_engine: Callable[[], Any]) -> CountingEngine:
        """The engine to hand this adapter's worker: ``make_engine()``'s, recorded in this connector's stats."""
        return CountingEngine(make_engine, self.transfer_stats)

    def _failed_recving(self, recving: set[str] | None) -> set[str]:
        """D's requests among ``recving`` whose load failed (taken: reported once)."""
        return set()

    def _load_error_blocks(self) -> set[int]:
        """Block ids whose load failed since the last call."""
        return set()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished` plus D's failed loads by request (see `core.vllm_glue.transfer_results`)."""
        sending, recving = self.get_finished(finished_req_ids)
        return transfer_results(sending, recving, self._failed_recving(recving), self._num_groups)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed (see `core.vllm_glue.block_load_errors`)."""
        return block_load_errors(self._load_error_blocks(), self._num_groups)


class SchedRequestAdapter(MooncakeAdapterBase, Generic[SchedT, WorkT]):
    """The pull and push adapters: one scheduler and one worker, requests seen as `SchedRequest`.

    ``_bind_flag`` names the params flag whose prompt binding the scheduler checks (`admit_bound`).
    """

    _bind_flag: ClassVar[str]

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        """Empty role slots; the subclass fills the one its role needs."""
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: SchedT | None = None
        self._worker: WorkT | None = None

    def _sched(self) -> SchedT:
        if self._scheduler is None:
            raise ConfigError("role", "WORKER", "SCHEDULER for this call")
        return self._scheduler

    def _work(self) -> WorkT:
        if self._worker is None:
            raise ConfigError("role", "SCHEDULER", "WORKER for this call")
        return self._worker

    def _admitted(self, request: Request, *, digest: bool = False) -> SchedRequest:
        """The request as the scheduler sees it; params failing the gate or the binding are dropped (one warning).

        ``digest``: also hash the prompt (only what hands out or announces params needs it).
        """
        if self._gate is None:
            raise ConfigError("role", "WORKER", "SCHEDULER for this call")
        admit_bound(self._gate, request, self._bind_flag)
        return sched_request(request, digest=digest)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens loaded from the peer (async); a pure query, as vLLM requires (it may ask again next step).

        Params that fail the gate or the prompt binding give ``(0, False)``: nothing is logged or
        changed here; the next hook that may change the request drops them.
        """
        sched = self._sched()
        assert self._gate is not None
        if (
            not self._gate.accepts(request.request_id, request.kv_transfer_params, request.num_prompt_tokens)
            or prompt_binding_error(request, self._bind_flag) is not None
        ):
            return 0, False
        return sched.get_num_new_matched_tokens(sched_request(request), num_computed_tokens)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` of this worker."""
        sending, recving = self._work().get_finished()
        return sending or None, recving or None

    def _load_error_blocks(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """Stop threads, sockets and registrations."""
        if self._worker is not None:
            self._worker.shutdown()
