"""vLLM's own plugin loading finds our entry point and registers our names (pinned vLLM, fresh processes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_dist import plugin
from ascend_dist.plugin import startup_hooks

# Fresh processes each import vLLM (~15 s alone, far more on a loaded 2-core machine).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]
PROBE = Path(__file__).with_name("plugin_vllm_probe.py")


def _probe(*args):
    env = {"VLLM_PLUGINS": "ascend_dist", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=180, env=env, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_vllm_plugin_loading_registers_every_installed_connector_once():
    seen = _probe()
    installed = [c for c in plugin.COMPONENTS + plugin.VLLM_NAME_OVERRIDES if plugin._installed(c.module)]
    hooks = {f"startup:{h.name}" for h in startup_hooks.HOOKS if plugin._installed(h.module)}
    assert set(seen["ours"]) == {f"{c.factory}:{c.name}" for c in installed} | hooks
    assert {c.name for c in installed if c.factory == "kv_connector"} <= set(seen["in_vllm"])
    assert {"hccl", "npu_ipc"} <= set(seen["weight_engines"]) and {"hccl", "npu_ipc"} <= set(seen["trainer_engines"])
    assert "MooncakeConnectorV1" in seen["in_vllm"]
    # Issue 25 item 6: EPLB at start-up (was a documented manual step): vLLM's EPLB module, imported after
    # the plugin loaded, comes with our communicator factory and async commit wrapped
    assert seen["eplb_wrapped"] == [True, True, True] and seen["hooks_ran"]["eplb"].startswith("ok"), seen
    assert seen["eplb_state_source_readable"]  # the hooked module's loader still answers get_source


def test_a_name_registered_first_by_someone_else_is_kept_with_one_warning():
    seen = _probe("--preregister", "MooncakeConnectorV1")
    assert "kv_connector:MooncakeConnectorV1" not in seen["ours"]
    warnings = [m for m in seen["logs"] if "MooncakeConnectorV1" in m and "already registered" in m]
    assert len(warnings) == 1


def test_vllm_ascend_offload_names_select_our_connectors_and_vllms_stay_reachable_by_module_path():
    """Issue 21 item 13: a vllm-ascend config naming `OffloadingConnector` must not get vLLM's stock class."""
    seen = _probe("--resolve", "OffloadingConnector", "SimpleCPUOffloadConnector", "MooncakeConnectorV1")
    assert seen["resolved"] == {
        "OffloadingConnector": "ascend_dist.kv_offload.vllm_native:AscendOffloadingConnector",
        "SimpleCPUOffloadConnector": "ascend_dist.kv_offload.vllm_simple:AscendSimpleCPUOffloadConnector",
        "MooncakeConnectorV1": "ascend_dist.kv_mooncake.pull.vllm_connector:MooncakeConnectorV1",
    }
    assert seen["by_module_path"] == {
        "OffloadingConnector": "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:OffloadingConnector",
        "SimpleCPUOffloadConnector": (
            "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector:SimpleCPUOffloadConnector"
        ),
    }
    assert {"kv_connector:OffloadingConnector", "kv_connector:SimpleCPUOffloadConnector"} <= set(seen["ours"])
    said = [m for m in seen["logs"] if "(vllm-ascend's name) selects" in m]
    assert len(said) == 2, seen["logs"]  # one line per replaced vLLM name, saying what it selects now


def test_an_offload_name_another_plugin_replaced_first_is_kept_with_one_warning():
    seen = _probe("--third-party", "OffloadingConnector")
    assert "OffloadingConnector" in seen["in_vllm"]
    assert "kv_connector:OffloadingConnector" not in seen["ours"]
    warnings = [m for m in seen["logs"] if "OffloadingConnector" in m and "already registered" in m]
    assert len(warnings) == 1


def _logging_probe(**extra_env: str) -> list[str]:
    env = {"VLLM_PLUGINS": "ascend_dist", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **extra_env}
    out = subprocess.run(
        [sys.executable, str(PROBE), "--logging"], capture_output=True, text=True, timeout=180, env=env, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return (out.stdout + out.stderr).splitlines()


def test_our_log_records_go_out_through_vllms_handlers_in_its_format():
    """Without the routing our warnings reached no handler in `vllm serve` (bare lines, INFO dropped)."""
    lines = _logging_probe()
    said = {text: [line for line in lines if line.endswith(text)] for text in ("a read failed", "a read took long")}
    for text, found in said.items():
        assert len(found) == 1, (text, lines[-20:])  # once: through vLLM's handler, not also Python's last resort
        assert "pid=" in found[0] and "[" in found[0], found  # vLLM's format: process, pid, file:line
    assert not any("a debug detail" in line for line in lines)  # vLLM's level (INFO) holds for ours


def test_ascend_dist_log_level_debug_adds_our_debug_lines_alone():
    lines = _logging_probe(ASCEND_DIST_LOG_LEVEL="DEBUG")
    found = [line for line in lines if line.endswith("a debug detail")]
    assert len(found) == 1 and "DEBUG" in found[0], lines[-20:]
    assert not any(" DEBUG " in line for line in lines if "a debug detail" not in line)  # vLLM stays at INFO
