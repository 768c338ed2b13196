"""vLLM's own plugin loading finds our entry point and registers our names (pinned vLLM, fresh processes)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_dist import plugin

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
    installed = [c for c in plugin.COMPONENTS if plugin._installed(c.module)]
    assert set(seen["ours"]) == {f"{c.factory}:{c.name}" for c in installed}
    assert {c.name for c in installed if c.factory == "kv_connector"} <= set(seen["in_vllm"])
    assert {"hccl", "npu_ipc"} <= set(seen["weight_engines"]) and {"hccl", "npu_ipc"} <= set(seen["trainer_engines"])
    assert "MooncakeConnectorV1" in seen["in_vllm"]


def test_a_name_registered_first_by_someone_else_is_kept_with_one_warning():
    seen = _probe("--preregister", "MooncakeConnectorV1")
    assert "kv_connector:MooncakeConnectorV1" not in seen["ours"]
    warnings = [m for m in seen["logs"] if "MooncakeConnectorV1" in m and "already registered" in m]
    assert len(warnings) == 1
