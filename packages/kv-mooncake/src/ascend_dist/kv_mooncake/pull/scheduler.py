"""Scheduler side of the pull connector: what D loads, what P lends, and the hand-off params.

Runs in: the scheduler process of P and of D (the same class; the role decides what fires).
Works on plain values (`SchedRequest`, block-id lists); the vLLM adapter translates vLLM's
objects. `get_num_new_matched_tokens` is a pure query; what a request needs from the workers is
recorded in `update_state_after_alloc` / `request_finished` and handed out (and dropped) by the
next `build_connector_meta`, so nothing accumulates. D's per-request state lives in the workers
(`ascend_dist.kv_mooncake.pull.d_requests`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import DeploymentSecret
from ascend_dist.common.zmq_server import tcp_endpoint
from ascend_dist.kv_mooncake.core.admission import check_block_ids
from ascend_dist.kv_mooncake.core.blocks import trim_block_ids
from ascend_dist.kv_mooncake.core.capability import PULL_PURPOSE, Capability, expiry_ms, sign_capability
from ascend_dist.kv_mooncake.core.ports import MAX_PORT, PortLayout
from ascend_dist.kv_mooncake.core.request import SchedRequest
from ascend_dist.kv_mooncake.pull.config import PullConfig
from ascend_dist.kv_mooncake.pull.messages import TransferParams, parse_transfer_params
from ascend_dist.kv_mooncake.pull.step_metadata import PullMetadata, ReqMeta

__all__ = ["PullMetadata", "PullScheduler", "ReqMeta", "SchedRequest"]

logger = logging.getLogger(__name__)


class PullScheduler:
    """The scheduler half of ``MooncakeConnectorV1``."""

    def __init__(
        self,
        config: PullConfig,
        block_sizes: Sequence[int],
        window_blocks: Sequence[int] = (),
        *,
        state_groups: Sequence[int] = (),
        num_speculative_tokens: int = 0,
        secret: DeploymentSecret | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Create the scheduler.

        Args:
            config: The connector configuration.
            block_sizes: Tokens per block of each KV-cache group.
            window_blocks: Per group, ``ceil(window / block) + 1`` for sliding-window groups, else 0.
            state_groups: Indices of the state (Mamba/linear-attention) groups. With any, P drops
                the last prompt token (a recurrent state cannot be rewound) and D
                loads ``prompt - 1`` tokens, then recomputes the last one.
            num_speculative_tokens: Speculative tokens (P's state block is the ``spec + 1``-th last).
            secret: The deployment secret: P signs the params it hands out (`core.capability`),
                valid for ``lease_s + pull_timeout_s``; None hands them out unsigned.
            wall_clock: Wall seconds for the capability's expiry (injectable for tests).

        Raises:
            ConfigError: No groups, the lists differ in length, a group index is out of range,
                or a combination is unsupported (sliding window with context parallelism, or a
                window on a state group).
        """
        if not block_sizes or any(b <= 0 for b in block_sizes):
            raise ConfigError("block_sizes", list(block_sizes), "one positive int per KV-cache group")
        windows = list(window_blocks) or [0] * len(block_sizes)
        if len(windows) != len(block_sizes):
            raise ConfigError("window_blocks", windows, f"{len(block_sizes)} entries (one per group)")
        if config.uses_cp and any(windows):
            raise ConfigError("window_blocks", windows, "all 0 with context parallelism (SWA + CP is not supported)")
        states = sorted(set(state_groups))
        if any(not 0 <= g < len(block_sizes) for g in states):
            raise ConfigError("state_groups", states, f"group indices in [0, {len(block_sizes)})")
        if any(windows[g] for g in states):
            raise ConfigError("window_blocks", windows, "0 for state groups")
        if num_speculative_tokens < 0:
            raise ConfigError("num_speculative_tokens", num_speculative_tokens, "an int >= 0")
        self._secret = secret
        self._wall_clock = wall_clock
        self._states = states
        self._attn_block = next((b for g, b in enumerate(block_sizes) if g not in states), block_sizes[0])
        self._num_spec = num_speculative_tokens
        self._config = config
        self._block_sizes = list(block_sizes)
        self._windows = windows
        layout = PortLayout(
            kv_port=config.kv_port,
            tp_size=config.prefill.tp_size,
            pp_size=config.prefill.pp_size,
            pcp_size=config.prefill.pcp_size,
            dp_size=config.prefill.dp_size,
        )
        # With CP on P each scheduler block id covers cp blocks' worth of prompt.
        self._p_cp = config.prefill.cp_size if config.is_producer else 1
        self._remote_port = layout.dp_base(config.dp_rank) if config.is_producer else 0
        self._ports = config.prefill.tp_size * config.prefill.pp_size * config.prefill.pcp_size
        self._rank_hosts: list[str] = []  # P: host of port remote_port + i, when the ranks span nodes
        self._pending: dict[str, ReqMeta] = {}
        self._to_send: list[str] = []
        self._in_batch: set[str] = set()
        self._to_drop: list[str] = []

    @property
    def tracked(self) -> int:
        """Requests with scheduler state (0 when idle: nothing leaks)."""
        return len(self._pending) + len(self._to_send) + len(self._in_batch) + len(self._to_drop)

    @property
    def rank_hosts(self) -> list[str]:
        """P: the host of each of this instance's ports (empty while every rank is on ``host``)."""
        return list(self._rank_hosts)

    def set_rank_addresses(self, addresses: Iterable[tuple[str, int]]) -> None:
        """P: where each worker's side channel listens, from vLLM's handshake metadata of every worker.

        A P instance whose ranks span nodes has workers on other hosts than this scheduler's
        ``host``: the params then name each port's host (``remote_rank_hosts``), and D reads each
        rank there. Ports outside this DP rank's range are logged and ignored.

        Raises:
            ConfigError: A host that is a wildcard or malformed (names ``handshake_metadata.host``).
        """
        if not self._config.is_producer:
            return
        hosts = [""] * self._ports
        for host, port in addresses:
            tcp_endpoint(host, 0)  # a specific address: a wildcard is not reachable from D
            i = port - self._remote_port
            if not 0 <= i < self._ports:
                logger.warning("handshake metadata names port %d outside P's ports %d..%d: ignored", port,
                               self._remote_port, self._remote_port + self._ports - 1)  # fmt: skip
                continue
            hosts[i] = "" if host == self._config.host else host
        self._rank_hosts = hosts if any(hosts) else []  # all on this node: the params stay as before
        if self._rank_hosts:
            logger.info("P ranks span nodes: port -> host %s", {self._remote_port + i: h or self._config.host
                        for i, h in enumerate(hosts)})  # fmt: skip

    def check_params(self, request_id: str, raw: Mapping[str, Any], prompt_len: int) -> TransferParams:
        """The strict check the vLLM adapter's `ParamsGate` runs before any hook sees a request's params.

        Beyond `parse_transfer_params`: the flag must suit this instance's role (only P lends, only
        D pulls), and a pull must name one block list per KV-cache group of no more blocks than the
        prompt needs, P's TP size as configured (or none) and a base port that fits P's ports.
        A pure function of its arguments (``request_id`` is unused here).

        Raises:
            ConfigError: Names ``kv_transfer_params.<key>``.
        """
        params = parse_transfer_params(raw)
        producer = self._config.is_producer
        if params.do_remote_prefill and producer:
            raise ConfigError("kv_transfer_params.do_remote_prefill", True, "false on P (kv_producer): P never pulls")
        if params.do_remote_decode and not producer:
            raise ConfigError("kv_transfer_params.do_remote_decode", True, "false on D (kv_consumer): D never lends")
        if not params.do_remote_prefill:
            return params
        p = self._config.prefill
        if params.remote_ptp_size and params.remote_ptp_size != p.tp_size:
            raise ConfigError(
                "kv_transfer_params.remote_ptp_size", params.remote_ptp_size, f"prefill.tp_size={p.tp_size} or absent"
            )
        span = p.tp_size * p.pp_size * p.pcp_size
        if (params.remote_port or 0) + span - 1 > MAX_PORT:
            raise ConfigError(
                "kv_transfer_params.remote_port", params.remote_port, f"a base with {span} ports <= 65535"
            )
        block = min([*self._block_sizes, params.remote_block_size or self._attn_block])
        per_group = math.ceil(max(prompt_len, 1) / block) + 2 + self._num_spec
        check_block_ids("remote_block_ids", params.remote_block_ids or [], len(self._block_sizes), per_group)
        return params

    def get_num_new_matched_tokens(self, request: SchedRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens D will load from P beyond its local prefix hit, and whether asynchronously.

        A pure query (vLLM may ask again for a request it could not schedule): it writes neither the
        request nor this scheduler. P's truncation for state groups is `truncate_for_state` (run by
        the adapter's ``on_new_request``); D's pull is recorded by `update_state_after_alloc`.

        Raises:
            ConfigError: The request's ``kv_transfer_params`` are invalid (names the key).
        """
        if not request.kv_transfer_params:
            return 0, False
        params = parse_transfer_params(request.kv_transfer_params)
        if not params.do_remote_prefill:
            return 0, False
        disagreement = self._disagreement(params)
        if disagreement:
            # Pairing blocks with different windows or group kinds would load wrong bytes: D
            # recomputes the prompt instead, and the empty receive still tells P to free (logged
            # once, by `update_state_after_alloc`: this query may run many times).
            return 0, False
        count = max(self.loaded_len(request.prompt_len) - num_computed_tokens, 0)
        return (count, True) if count else (0, False)

    def loaded_len(self, prompt_len: int) -> int:
        """Prompt tokens D loads from P: all, or all but the last with state groups (D recomputes it)."""
        return prompt_len - 1 if self._states and prompt_len > 1 else prompt_len

    def _disagreement(self, params: TransferParams) -> str:
        """Why P's groups cannot be paired with D's (empty when they agree, or P did not say)."""
        if params.remote_window_blocks is not None and list(params.remote_window_blocks) != self._windows:
            return (
                f"kv_transfer_params.remote_window_blocks={params.remote_window_blocks} differs from D's "
                f"sliding-window blocks per group {self._windows}"
            )
        p_block, d_block = params.remote_block_size, self._attn_block
        if p_block and p_block != d_block and any(self._windows):
            return (
                f"kv_transfer_params.remote_block_size={p_block} differs from D's {d_block}: "
                "not supported with sliding-window groups"
            )
        if p_block and p_block != d_block and self._config.uses_cp:
            ratio = (self._config.prefill.cp_size // self._config.decode.cp_size) or 1
            if d_block % p_block or ratio % (d_block // p_block):
                return (
                    f"kv_transfer_params.remote_block_size={p_block} with D's {d_block} and context parallelism: "
                    f"D's block must be r x P's with (P cp / D cp) = {ratio} a multiple of r"
                )
        if params.remote_state_groups is not None and sorted(params.remote_state_groups) != self._states:
            return (
                f"kv_transfer_params.remote_state_groups={params.remote_state_groups} differs from D's "
                f"state groups {self._states}"
            )
        return ""

    def truncate_for_state(self, request: SchedRequest) -> bool:
        """P with state groups: drop the request's last prompt token, once.

        P then computes the state after ``N - 1`` tokens and D recomputes token ``N`` from it.
        Sets ``prompt_len -= 1`` and ``kv_transfer_params["_p_side_truncated"]`` (the guard
        against truncating again after a preemption); the caller mirrors the change on its own
        request object (dropping the token, ``max_tokens = 1``).

        Returns:
            Whether the request was truncated now.
        """
        params = request.kv_transfer_params
        if not self._states or params is None or params.get("_p_side_truncated") or request.prompt_len <= 1:
            return False
        if not params.get("do_remote_decode"):
            return False
        request.prompt_len -= 1
        params["_p_side_truncated"] = True
        return True

    def update_state_after_alloc(
        self, request: SchedRequest, local_block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Record D's pull into the freshly allocated (not prefix-hit) blocks.

        Args:
            request: The request.
            local_block_ids: Per group, the new blocks to load into.
            num_external_tokens: What `get_num_new_matched_tokens` promised (0 = nothing to load).
        """
        raw = request.kv_transfer_params
        if not raw:
            return
        params = parse_transfer_params(raw)
        if params.do_remote_prefill or params.do_remote_decode:
            self._in_batch.add(request.request_id)
        if not params.do_remote_prefill:
            return
        groups = len(self._block_sizes)
        local = [list(ids) for ids in local_block_ids] if num_external_tokens > 0 else [[] for _ in range(groups)]
        loaded = self.loaded_len(request.prompt_len)
        if num_external_tokens == 0 and (disagreement := self._disagreement(params)):
            logger.error("request %s: not loading from P: %s", request.request_id, disagreement)
        # vLLM hands back what the query answered (loaded - prefix hit), so D's hit is recovered here
        # rather than written into the request by the query.
        computed = loaded - num_external_tokens if num_external_tokens > 0 else 0
        if len(local) != groups:
            raise ConfigError("local_block_ids", f"<{len(local)} groups>", f"{groups} lists (one per KV-cache group)")
        self._pending[request.request_id] = self._req_meta(
            request.request_id,
            params,
            local,
            computed=max(computed, 0),
            prompt_len=loaded,
            notify_only=num_external_tokens == 0,
        )
        raw["do_remote_prefill"] = False

    def _req_meta(
        self,
        request_id: str,
        params: Any,
        local: list[list[int]],
        *,
        computed: int,
        prompt_len: int,
        notify_only: bool = False,
    ) -> ReqMeta:
        remote = [list(ids) for ids in params.remote_block_ids or []]
        if len(remote) != len(local):
            raise ConfigError(
                "kv_transfer_params.remote_block_ids",
                f"<{len(remote)} groups>",
                f"{len(local)} lists (one per KV-cache group)",
            )
        return ReqMeta(
            request_id=request_id,
            local_block_ids=local,
            remote_block_ids=remote,
            num_computed_tokens=computed,
            remote_request_id=params.remote_request_id or "",
            remote_engine_id=params.remote_engine_id or "",
            remote_host=params.remote_host or "",
            remote_port=params.remote_port or 0,
            remote_ptp_size=params.remote_ptp_size or self._config.prefill.tp_size,
            do_virtual=params.do_virtual,
            prompt_len=prompt_len,
            window_blocks=list(self._windows),
            state_groups=list(self._states),
            num_speculative_tokens=self._num_spec,
            remote_block_size=params.remote_block_size or 0,
            notify_only=notify_only,
            prompt_digest=params.remote_prompt_digest or "",
            capability=params.remote_capability or "",
            capability_expires_ms=params.remote_capability_expires or 0,
            remote_rank_hosts=list(params.remote_rank_hosts or []),
        )

    def build_connector_meta(self) -> PullMetadata:
        """This step's work for the workers; resets the pending collections."""
        meta = PullMetadata(
            requests=self._pending, to_send=self._to_send, in_batch=sorted(self._in_batch), to_drop=self._to_drop
        )
        self._pending, self._to_send, self._in_batch, self._to_drop = {}, [], set(), []
        return meta

    def _drop(self, request_id: str) -> None:
        """P: the request ends without lending its blocks; tell the workers unless they never heard of it."""
        if request_id in self._in_batch:
            self._in_batch.discard(request_id)  # not yet announced to the workers
        else:
            self._to_drop.append(request_id)

    def request_finished(
        self, request: SchedRequest, block_ids: Sequence[Sequence[int]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Decide delayed free and P's hand-off params.

        Returns:
            ``(delay_free, kv_transfer_params)``.
        """
        raw = request.kv_transfer_params
        if not raw:
            return False, None
        params = parse_transfer_params(raw)
        if params.do_remote_prefill:
            # D request rejected before allocation: an empty receive still tells P to free.
            empty = [[] for _ in self._block_sizes]
            self._pending[request.request_id] = self._req_meta(
                request.request_id, params, empty, computed=0, prompt_len=request.prompt_len, notify_only=True
            )
            raw["do_remote_prefill"] = False
            return False, None
        if not params.do_remote_decode:
            return False, None
        if not request.length_capped:
            # Stopped (EOS, even on the first token) or aborted: nothing is lent, P's workers forget it.
            self._drop(request.request_id)
            return False, None
        trimmed = [
            list(ids) if g in self._states else trim_block_ids(ids, request.prompt_len, bs * self._p_cp, win)
            for g, (ids, bs, win) in enumerate(zip(block_ids, self._block_sizes, self._windows, strict=True))
        ]
        delay = any(trimmed)
        if delay:
            self._to_send.append(request.request_id)
        else:
            self._drop(request.request_id)  # nothing to lend: D gets empty ids and sends no DONE
        return delay, self._sign(
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": trimmed,
                "remote_engine_id": self._config.engine_id,
                "remote_request_id": request.request_id,
                "remote_host": self._config.host,
                "remote_port": self._remote_port,
                "remote_ptp_size": self._config.prefill.tp_size,
                "remote_block_size": self._attn_block,
                "num_prompt_blocks": math.ceil(request.prompt_len / self._attn_block),
                "remote_window_blocks": list(self._windows),
                "remote_state_groups": list(self._states),
                **({"remote_rank_hosts": list(self._rank_hosts)} if self._rank_hosts else {}),
                **(
                    {"remote_prompt_tokens": request.prompt_len, "remote_prompt_digest": request.prompt_digest}
                    if request.prompt_digest is not None
                    else {}
                ),
            }
        )

    def _sign(self, params: dict[str, Any]) -> dict[str, Any]:
        """P's params with its capability added (unchanged without a secret).

        Valid for the lease plus D's pull timeout: past that P has freed the blocks anyway.
        """
        if self._secret is None:
            return params
        expires = expiry_ms(self._config.lease_s + self._config.pull_timeout_s, self._wall_clock)
        capability = Capability(
            params["remote_request_id"],
            params["remote_engine_id"],
            params["remote_block_ids"],
            params.get("remote_prompt_digest") or "",
            expires,
            list(params.get("remote_rank_hosts") or []),
        )
        params["remote_capability"] = sign_capability(self._secret, PULL_PURPOSE, capability)
        params["remote_capability_expires"] = expires
        return params
