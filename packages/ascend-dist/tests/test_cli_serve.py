"""`ascend-dist demo pd --serve` without vLLM: the proxy's rules, /metrics parsing, the process plumbing.

The walk through real ``vllm serve`` engines is the engine tier's ``tests/engine/test_serve.py``.
Here: what the proxy sends P and D (vllm-ascend's proxy's rules), that a P answer without
``kv_transfer_params`` is an error and never a silent recompute, the stats lines read from a
Prometheus page, and a real proxy process started, found healthy and killed with its group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_dist.cli.engines.serve import Launch, ServeStack, metric_total, transfer_stats_lines
from ascend_dist.cli.engines.serve_proxy import ProxyError, decode_request, prefill_request
from ascend_dist.cli.main import build_parser

BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0, "stream_options": {"x": 1}}


def test_p_gets_one_token_and_do_remote_decode_d_gets_ps_params() -> None:
    to_p = prefill_request(BODY)
    assert to_p["max_tokens"] == 1 and to_p["stream"] is False and "stream_options" not in to_p
    assert to_p["kv_transfer_params"]["do_remote_decode"] is True
    assert to_p["prompt"] == BODY["prompt"] and BODY["max_tokens"] == 8  # the client's body is not changed
    params = {"remote_engine_id": "p", "remote_block_ids": [[0]], "do_remote_prefill": True}
    to_d = decode_request(BODY, {"choices": [], "kv_transfer_params": params})
    assert to_d == {**BODY, "kv_transfer_params": params}


@pytest.mark.parametrize("answer", [{"choices": []}, {"kv_transfer_params": None}, {"kv_transfer_params": "x"}, []])
def test_a_p_answer_without_params_is_a_502_not_a_recompute_on_d(answer: object) -> None:
    with pytest.raises(ProxyError) as info:
        decode_request(BODY, answer)
    assert info.value.status == 502 and "kv_transfer_params" in str(info.value)


def test_streaming_is_refused() -> None:
    with pytest.raises(ProxyError) as info:
        prefill_request({**BODY, "stream": True})
    assert info.value.status == 400


METRICS = """\
# HELP vllm:mooncake_bytes_transferred Histogram of bytes transferred per transfer
vllm:mooncake_bytes_transferred_bucket{engine="0",le="2048.0",model_name="tiny"} 0.0
vllm:mooncake_bytes_transferred_sum{engine="0",model_name="tiny"} 393216.0
vllm:mooncake_bytes_transferred_count{engine="0",model_name="tiny"} 3.0
vllm:mooncake_num_failed_transfers_total{engine="0",kind="timeout",model_name="tiny"} 0.0
vllm:mooncake_xfer_time_seconds_created{engine="0",model_name="tiny"} 1.7e9
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 832.0
"""


def test_stats_lines_are_ours_without_buckets_and_totals_sum_label_sets() -> None:
    lines = transfer_stats_lines(METRICS)
    assert [line.split("{")[0] for line in lines] == [
        "vllm:mooncake_bytes_transferred_sum",
        "vllm:mooncake_bytes_transferred_count",
        "vllm:mooncake_num_failed_transfers_total",
    ]
    assert metric_total(METRICS, "vllm:mooncake_bytes_transferred_sum") == 393216.0
    assert metric_total("", "vllm:mooncake_bytes_transferred_sum") == 0.0  # absent reads as nothing moved


def test_the_printed_command_is_a_shell_line_with_its_environment() -> None:
    launch = Launch(("python", "-m", "x", "--kv-transfer-config", '{"a": 1}'), {"VLLM_CACHE_ROOT": "/c d"})
    assert launch.shell() == "VLLM_CACHE_ROOT='/c d' python -m x --kv-transfer-config '{\"a\": 1}'"


def test_serve_is_a_demo_flag() -> None:
    args = build_parser().parse_args(["demo", "pd", "--serve"])
    assert args.serve and args.scenarios == ["pd"]


def test_a_real_proxy_process_is_healthy_on_loopback_and_dies_with_its_group(tmp_path: Path) -> None:
    with ServeStack(sys.executable, tmp_path, tmp_path) as stack:
        proxy = stack.start_proxy("proxy", "http://127.0.0.1:9", "http://127.0.0.1:9")
        stack.wait_ready([proxy], 30.0)
        assert proxy.url.startswith("http://127.0.0.1:")
        pid = proxy._proc.pid
    assert not proxy.alive
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole group is gone


def test_the_proxy_refuses_a_wildcard_address() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ascend_dist.cli.engines.serve_proxy", "--prefill", "http://127.0.0.1:1",
         "--decode", "http://127.0.0.1:2", "--host", "0.0.0.0", "--port", "0"],
        check=False, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2 and "wildcard" in result.stderr
