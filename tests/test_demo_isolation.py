"""Importing library code never imports demo code (issue 17: demos live in `_demo/` subpackages).

Every public module of every member, and every module the vLLM plugin registers, is imported by a
process that has loaded no `ascend_dist` module before; none may bring in a `_demo`, `scenario*` or
`*synthetic*` module. Modules that reach vLLM at import time run in the `vllm`-marked test.
"""

from __future__ import annotations

import pytest
from demo_isolation import HEAVY, all_modules, is_demo, library_modules, needs_vllm, probe

from ascend_dist.plugin import COMPONENTS

pytestmark = pytest.mark.timeout(600)

MODULES = all_modules()
LIBRARY = library_modules(MODULES)
VLLM = needs_vllm(MODULES)
PLAIN = [m for m in LIBRARY if m not in VLLM]
# The plugin's paths may name modules that are not on disk (yet): they are checked all the same.
WITH_VLLM = sorted({m for m in LIBRARY if m in VLLM} | {c.module for c in COMPONENTS})


@pytest.fixture(scope="module")
def plain_results() -> dict[str, dict[str, object]]:
    return probe(PLAIN, timeout_s=540)


@pytest.fixture(scope="module")
def vllm_results() -> dict[str, dict[str, object]]:
    # vLLM's own import is the slow part (~15 s): paid once, before the forks.
    return probe(WITH_VLLM, timeout_s=540, preload=(*HEAVY, "vllm", "vllm.config"))


def _assert_no_demo(name: str, result: dict[str, object]) -> None:
    assert "error" not in result, f"import {name} failed: {result['error']}"
    loaded = result["loaded"]
    assert isinstance(loaded, list)
    demo = [m for m in loaded if is_demo(m)]
    assert not demo, f"import {name} loads demo code: {demo}"


@pytest.mark.parametrize("name", PLAIN)
def test_library_module_imports_no_demo_code(name: str, plain_results: dict[str, dict[str, object]]) -> None:
    _assert_no_demo(name, plain_results[name])


@pytest.mark.vllm
@pytest.mark.parametrize("name", WITH_VLLM)
def test_vllm_module_imports_no_demo_code(name: str, vllm_results: dict[str, dict[str, object]]) -> None:
    _assert_no_demo(name, vllm_results[name])


def test_every_member_has_library_modules_checked() -> None:
    # A walker that finds nothing would pass every check above.
    members = {m.split(".")[1] for m in LIBRARY}
    expected = {"common", "hccl_ctypes", "kv_mooncake", "kv_store", "kv_offload", "eplb_ascend"}
    assert expected | {"weight_transfer", "plugin", "parallel"} <= members
    assert "ascend_dist.kv_store.vllm_connector" in VLLM
    assert "ascend_dist.common.errors" in PLAIN


def test_the_probe_sees_a_demo_import() -> None:
    # The check itself: a module that imports a demo module is caught by the same probe and rule.
    result = probe(["ascend_dist.kv_offload._demo.scenario"], timeout_s=120)
    loaded = result["ascend_dist.kv_offload._demo.scenario"]["loaded"]
    assert isinstance(loaded, list) and any(is_demo(m) for m in loaded)


@pytest.mark.parametrize(
    ("name", "demo"),
    [
        ("ascend_dist.kv_store._demo.scenario", True),
        ("ascend_dist.kv_mooncake.scenario_pd", True),
        ("ascend_dist.kv_mooncake.synthetic_state", True),
        ("ascend_dist.common.scenarios", True),
        ("ascend_dist.kv_store.vllm_connector", False),
        ("ascend_dist.common.device.cpu_sim", False),
        ("vllm.scenario", False),
    ],
)
def test_demo_names(name: str, demo: bool) -> None:
    assert is_demo(name) is demo
