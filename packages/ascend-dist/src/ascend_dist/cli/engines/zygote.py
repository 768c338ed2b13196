"""The zygote: imports vLLM once, then forks one process per engine (``python -m ascend_dist.cli.engines.zygote``).

Runs in: the engine environment (vLLM's CPU build). Reads `wire` requests on stdin and answers on
stdout; vLLM's own logging goes to stderr. Each forked engine serves one connection on its Unix
socket (`serve_engine`) and dies with the zygote (``PR_SET_PDEATHSIG``), which itself exits when its
stdin closes, so a crashed caller leaves no engine behind.

Fork safety: the zygote only imports vLLM and torch. It never runs a torch op (an OpenMP pool in
the parent can hang a forked child), so model writing happens in a forked child as well.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from ascend_dist.cli.engines.wire import (
    Completion,
    EngineSpec,
    Failure,
    Generate,
    Generated,
    Ready,
    Spawn,
    Spawned,
    WeightSync,
    WeightSynced,
    WriteModel,
    decode_request,
    encode,
)

__all__ = ["main", "serve_engine"]

ENGINE_ENV = {
    # The engine core (and the connector's worker) live in the engine's own process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
_PR_SET_PDEATHSIG = 1
_ACCEPT_TIMEOUT_S = 120.0


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _build_llm(spec: EngineSpec) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": spec.model,
        "skip_tokenizer_init": True,
        "dtype": spec.dtype,
        "block_size": spec.block_size,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "enable_prefix_caching": spec.enable_prefix_caching,
        "enforce_eager": True,
        "seed": spec.seed,
    }
    if spec.num_gpu_blocks_override is not None:
        kwargs["num_gpu_blocks_override"] = spec.num_gpu_blocks_override
    if spec.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = spec.kv_transfer_config
    if spec.scheduler_cls is not None:
        kwargs["scheduler_cls"] = spec.scheduler_cls
    if spec.weight_transfer_config is not None:
        from vllm.config import WeightTransferConfig

        kwargs["weight_transfer_config"] = WeightTransferConfig(**spec.weight_transfer_config)
    return LLM(**kwargs)


def _completion(output: Any) -> Completion:
    sample = output.outputs[0]
    logprobs = []
    for token, step in zip(sample.token_ids, sample.logprobs or [], strict=False):
        entry = step.get(token)
        logprobs.append(float(entry.logprob) if entry is not None else float("nan"))
    return Completion(
        token_ids=list(sample.token_ids),
        logprobs=logprobs,
        num_cached_tokens=int(output.num_cached_tokens or 0),
        finish_reason=sample.finish_reason,
        kv_transfer_params=output.kv_transfer_params,
        # vLLM ends a request whose KV load failed under kv_load_failure_policy="fail" (or that
        # failed otherwise on its own) with finish reason "error" and no exception.
        error="vLLM finished the request with an error" if sample.finish_reason == "error" else None,
    )


def _generate(llm: Any, request: Generate, counter: list[int]) -> Generated:
    """Run the batch through the engine's own step loop (`LLM.generate` does the same), with a deadline."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = []
    for p in request.prompts:
        counter[0] += 1
        rid = p.request_id or f"req-{counter[0]}"
        params = SamplingParams(
            max_tokens=p.max_tokens,
            ignore_eos=p.ignore_eos,
            temperature=0.0,
            logprobs=1,
            detokenize=False,
            extra_args={"kv_transfer_params": p.kv_transfer_params} if p.kv_transfer_params is not None else None,
        )
        engine.add_request(rid, {"prompt_token_ids": list(p.token_ids)}, params)
        ids.append(rid)
    start = time.perf_counter()
    deadline = time.monotonic() + request.timeout_s
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            engine.abort_request([r for r in ids if r not in done])
            raise TimeoutError(f"{len(ids) - len(done)} of {len(ids)} requests unfinished after {request.timeout_s} s")
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    missing = [r for r in ids if r not in done]
    if missing:
        raise RuntimeError(f"the engine returned no output for {missing}")
    return Generated([_completion(done[r]) for r in ids], time.perf_counter() - start)


class _WedgedError(TimeoutError):
    """A weight-sync call is still running inside vLLM past its deadline."""


def _weight_sync_call(llm: Any, request: WeightSync) -> None:
    """Call the one whitelisted `LLM` method, with vLLM's request shapes checked first (typed, naming the field)."""
    method = request.method
    if method in ("init_weight_transfer_engine", "update_weights"):
        key = "init_info" if method == "init_weight_transfer_engine" else "update_info"
        body = request.request
        if not isinstance(body, dict) or key not in body:
            raise TypeError(f"{method}: request must be an object with {key!r}, got {body!r:.200}")
        if method == "init_weight_transfer_engine":
            llm.init_weight_transfer_engine(body)
        else:
            llm.update_weights(body)
    elif request.request is not None:
        raise TypeError(f"{method}: takes no request, got {request.request!r:.200}")
    elif method == "start_weight_update":
        llm.start_weight_update()
    else:
        llm.finish_weight_update(weight_version=request.weight_version)
        # KV cached under the old weights must not answer prompts under the new ones (vLLM keeps it:
        # RL frameworks reset the prefix cache after each update, as `pause_generation(clear_cache=True)`)
        if not llm.reset_prefix_cache():
            raise RuntimeError(
                "finish_weight_update: the weights are loaded but vLLM refused to reset its prefix cache"
            )


def _weight_sync(llm: Any, request: WeightSync) -> WeightSynced:
    """Run the call in a thread and wait at most ``timeout_s``.

    A collective in vLLM cannot be interrupted, so a call past its deadline leaves the engine in
    an unknown state: the engine reports it and exits (`serve_engine`), never serving half-loaded
    weights. A call that raises is an ordinary failure: vLLM closed the update, the engine serves on.
    """
    failure: list[BaseException] = []

    def run() -> None:
        try:
            _weight_sync_call(llm, request)
        except BaseException as exc:  # handed to the serving thread
            failure.append(exc)

    start = time.perf_counter()
    # daemon: on a missed deadline the process exits without waiting for vLLM's call to return
    worker = threading.Thread(target=run, name=f"weight-sync-{request.method}", daemon=True)
    worker.start()
    worker.join(request.timeout_s)
    if worker.is_alive():
        raise _WedgedError(f"{request.method} did not return within {request.timeout_s} s")
    if failure:
        raise failure[0]
    version = llm.get_weight_version()
    return WeightSynced(request.method, time.perf_counter() - start, None if version is None else str(version))


def serve_engine(request: Spawn) -> None:
    """The body of a forked engine: bind, build vLLM's `LLM`, then answer `Generate`/`WeightSync` until EOF."""
    os.setpgid(0, 0)  # TP workers join this group, so one kill takes the whole engine down
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _die_with_parent()
    _redirect_output(request.log_path)
    os.environ.update(request.spec.env)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(request.socket_path)
    listener.listen(1)
    listener.settimeout(_ACCEPT_TIMEOUT_S)
    conn, _ = listener.accept()
    listener.close()
    conn.settimeout(None)
    stream = conn.makefile("rwb")
    start = time.perf_counter()
    try:
        llm = _build_llm(request.spec)
    except Exception as exc:
        traceback.print_exc()
        stream.write(encode(Failure(f"engine did not start: {type(exc).__name__}: {exc}")))
        stream.flush()
        os._exit(3)
    stream.write(encode(Ready(seconds=time.perf_counter() - start)))
    stream.flush()
    counter = [0]
    while line := stream.readline():
        wedged = False
        try:
            message = decode_request(line)
            if isinstance(message, Generate):
                reply: Generated | WeightSynced | Failure = _generate(llm, message, counter)
            elif isinstance(message, WeightSync):
                reply = _weight_sync(llm, message)
            else:
                raise TypeError(f"an engine serves only generate and weight_sync, not {type(message).__name__}")
        except _WedgedError as exc:
            wedged = True
            reply = Failure(f"{type(exc).__name__}: {exc}; the engine exits (its weights are unknown)")
        except Exception as exc:  # the request failed; the caller decides whether the engine is still usable
            traceback.print_exc()
            reply = Failure(f"{type(exc).__name__}: {exc}")
        stream.write(encode(reply))
        stream.flush()
        if wedged:
            sys.stdout.flush()
            os._exit(4)
    sys.stdout.flush()
    os._exit(0)  # the caller hung up: leave at once, as a killed engine would


def _write_model(request: WriteModel) -> Ready | Failure:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            from ascend_dist.cli.engines.model import write_model

            write_model(
                request.path,
                request.seed,
                architecture=request.architecture,
                num_layers=request.num_layers,
                redraw=request.redraw,
                redraw_seed=request.redraw_seed,
            )
        except Exception:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return Failure(f"writing the model into {request.path} failed (see the zygote's log)")
    return Ready(detail=request.path)


def main() -> int:
    """Import vLLM, announce `Ready`, then serve requests on stdin until it closes."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # vLLM logs to stdout; keep the protocol channel clean
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k not in os.environ})
    start = time.perf_counter()
    import vllm  # the point of the zygote: import once, fork many

    children: set[int] = set()

    def reap(*_: object) -> None:
        for pid in list(children):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    children.discard(pid)

    signal.signal(signal.SIGCHLD, reap)
    replies.write(encode(Ready(seconds=time.perf_counter() - start, detail=vllm.__version__)))
    replies.flush()
    for line in sys.stdin.buffer:
        try:
            request = decode_request(line)
        except Exception as exc:
            replies.write(encode(Failure(f"bad request: {exc}")))
            replies.flush()
            continue
        if isinstance(request, WriteModel):
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            reply: Ready | Spawned | Failure = _write_model(request)
            signal.signal(signal.SIGCHLD, reap)
        elif isinstance(request, Spawn):
            pid = os.fork()
            if pid == 0:
                replies.close()
                serve_engine(request)
            children.add(pid)
            reply = Spawned(pid)
        else:
            reply = Failure(f"the zygote does not serve {type(request).__name__}")
        replies.write(encode(reply))
        replies.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
