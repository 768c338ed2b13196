"""Messages between `EngineHost`, the zygote and the engines it forks: msgspec JSON, one per line.

Runs in: the caller (workspace or engine environment) and the engine environment. Only msgspec
and the standard library: the caller may not have vLLM.
"""

from __future__ import annotations

from typing import Any, Final, Literal, get_args

import msgspec

__all__ = [
    "Completion",
    "EngineSpec",
    "Failure",
    "Generate",
    "Generated",
    "Prompt",
    "Ready",
    "Spawn",
    "Spawned",
    "WEIGHT_SYNC_METHODS",
    "WeightSync",
    "WeightSynced",
    "WriteModel",
    "decode_reply",
    "decode_request",
    "encode",
]


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine is: vLLM's `LLM` arguments that the tier uses, plus its environment.

    ``kv_transfer_config`` is the dict vLLM's ``--kv-transfer-config`` takes (None: no connector).
    ``weight_transfer_config`` is the dict vLLM's ``--weight-transfer-config`` takes, e.g.
    ``{"backend": "hccl"}`` (None: the engine accepts no weight updates).
    ``scheduler_cls`` is vLLM's ``--scheduler-cls``: a class by its qualified name (None: vLLM's own).
    ``env`` is applied in the engine's process before vLLM reads it (e.g. the OMP binding for TP 2).
    """

    model: str
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 16
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    kv_transfer_config: dict[str, Any] | None = None
    weight_transfer_config: dict[str, Any] | None = None
    scheduler_cls: str | None = None
    seed: int = 0
    env: dict[str, str] = {}


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One request: token ids, greedy decoding of ``max_tokens``, optional ``kv_transfer_params``.

    ``kv_transfer_params`` is passed to vLLM exactly as a client would send it, garbage included.
    ``request_id`` is the external id (a proxy pairs P's and D's requests by it); default: a fresh one.
    ``ignore_eos`` (default on): the random model's EOS id may come first, and a request P finishes
    with it never reaches D, so checks would silently skip the transfer.
    """

    token_ids: list[int]
    max_tokens: int = 8
    kv_transfer_params: Any = None
    request_id: str | None = None
    ignore_eos: bool = True


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """What vLLM returned for one prompt (``error``: the request failed on its own)."""

    token_ids: list[int] = []
    logprobs: list[float] = []
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    error: str | None = None


class Spawn(msgspec.Struct, frozen=True, tag="spawn"):
    """Zygote: fork an engine that serves on the Unix socket ``socket_path``, logging to ``log_path``."""

    spec: EngineSpec
    socket_path: str
    log_path: str


class WriteModel(msgspec.Struct, frozen=True, tag="write_model"):
    """Zygote: write a tiny model with seeded random weights into ``path`` (see `model.write_model`)."""

    path: str
    seed: int
    num_layers: int = 4
    architecture: str = "llama"
    redraw: str = ""  # parameters whose names start with this are drawn from redraw_seed
    redraw_seed: int = 0


class Generate(msgspec.Struct, frozen=True, tag="generate"):
    """Engine: run these prompts in one batch (``timeout_s`` bounds the whole call)."""

    prompts: list[Prompt]
    timeout_s: float = 120.0


WeightSyncMethod = Literal[
    "init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update"
]
WEIGHT_SYNC_METHODS: Final[tuple[str, ...]] = get_args(WeightSyncMethod)
"""vLLM's four weight-sync methods of `LLM` (RL offline API): the only ones `WeightSync` may call."""


class WeightSync(msgspec.Struct, frozen=True, tag="weight_sync"):
    """Engine: call one of vLLM's weight-sync methods on its `LLM` (``timeout_s`` bounds the call).

    ``request`` is vLLM's request as JSON: ``{"init_info": {...}}`` for ``init_weight_transfer_engine``,
    ``{"update_info": {...}}`` for ``update_weights``, None for the other two. ``weight_version`` goes
    to ``finish_weight_update``; after it returns the engine resets vLLM's prefix cache (KV computed
    under the old weights must not be reused). Any other method name fails to decode (the field is
    ``method``).
    """

    method: WeightSyncMethod
    request: dict[str, Any] | None = None
    weight_version: str | None = None
    timeout_s: float = 120.0


class Spawned(msgspec.Struct, frozen=True, tag="spawned"):
    """Zygote: the engine process exists (it is ready once its socket answers `Ready`)."""

    pid: int


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Engine: constructed and serving; or zygote: a request (e.g. `WriteModel`) is done."""

    seconds: float = 0.0
    detail: str = ""


class Generated(msgspec.Struct, frozen=True, tag="generated"):
    """Engine: one `Completion` per prompt, in order, and the wall time of the batch."""

    completions: list[Completion]
    seconds: float


class WeightSynced(msgspec.Struct, frozen=True, tag="weight_synced"):
    """Engine: the weight-sync call returned; its wall time and the engine's weight version after it."""

    method: str
    seconds: float
    weight_version: str | None = None


class Failure(msgspec.Struct, frozen=True, tag="failure"):
    """Anything that could not be done, with the reason."""

    error: str


Request = Spawn | WriteModel | Generate | WeightSync
Reply = Spawned | Ready | Generated | WeightSynced | Failure

_encoder = msgspec.json.Encoder()
_requests = msgspec.json.Decoder(Request)
_replies = msgspec.json.Decoder(Reply)


def encode(message: Request | Reply) -> bytes:
    """One message as a JSON line."""
    return _encoder.encode(message) + b"\n"


def decode_request(line: bytes) -> Request:
    """Decode a request line (raises ``msgspec.DecodeError`` or ``ValidationError`` on garbage)."""
    return _requests.decode(line)


def decode_reply(line: bytes) -> Reply:
    """Decode a reply line (raises ``msgspec.DecodeError`` or ``ValidationError`` on garbage)."""
    return _replies.decode(line)
