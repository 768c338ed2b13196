"""The package's dependency rules, read from the sources' import statements.

core/ imports no transport; pull/, push/ and sfa/ import core/ and never each other; nothing outside
_demo/ imports _demo/; only the vLLM adapters, core/vllm_glue and the pd-vllm bench driver
(_demo/pd_vllm_driver.py) import vLLM (at module level or not); no module imports another ascend_dist
distribution than ascend_dist.common (kv-offload in particular: see common.host_pool_share).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src" / "ascend_dist" / "kv_mooncake"
TRANSPORTS = ("pull", "push", "sfa")
PREFIX = "ascend_dist.kv_mooncake."


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _area(path: Path) -> str:
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else ""


def _modules() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_rules_see_every_area() -> None:
    # A rename that empties an area would make every rule below pass vacuously.
    areas = {_area(p) for p in _modules()}
    assert {"core", "pull", "push", "sfa", "_demo"} <= areas


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_module_imports_follow_the_dependency_direction(path: Path) -> None:
    area = _area(path)
    ours = {name.removeprefix(PREFIX).split(".")[0] for name in _imports(path) if name.startswith(PREFIX)}
    if area == "_demo":
        return
    assert "_demo" not in ours, f"{path.name}: library code imports the demo package"
    if area == "core":
        assert not ours & set(TRANSPORTS), f"{path.name}: core imports a transport: {sorted(ours)}"
    elif area in TRANSPORTS:
        others = ours & (set(TRANSPORTS) - {area})
        assert not others, f"{area}/{path.name} imports another transport: {sorted(others)}"
    else:
        # The stable re-export modules at the top and under layerwise/ name exactly one transport each.
        assert len(ours & set(TRANSPORTS)) <= 1, f"{path.name} re-exports from several transports"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_only_the_adapters_import_vllm(path: Path) -> None:
    uses_vllm = any(name == "vllm" or name.startswith("vllm.") for name in _imports(path))
    rel = path.relative_to(SRC).as_posix()
    # _demo/pd_vllm_driver.py: the pd-vllm bench's driver of vLLM's Scheduler (demo code, never imported by the library)
    adapter = path.name == "vllm_connector.py" or rel in ("core/vllm_glue.py", "_demo/pd_vllm_driver.py")
    assert adapter or not uses_vllm, f"{path.relative_to(SRC)} imports vllm"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_no_other_distribution_is_imported(path: Path) -> None:
    # pyproject depends on ascend-dist-common only; the sparse offload manager's host pool (kv-offload)
    # is reached through ascend_dist.common.host_pool_share. _demo's bench driver may use the test kit.
    allowed = ("ascend_dist.kv_mooncake", "ascend_dist.common") + (
        ("ascend_dist.testing",) if _area(path) == "_demo" else ()
    )
    foreign = {n for n in _imports(path) if n.startswith("ascend_dist.") and not n.startswith(allowed)}
    assert not foreign, f"{path.name} imports another distribution: {sorted(foreign)}"


def test_a_violation_is_seen(tmp_path: Path) -> None:
    # The control: the reader does see an import of another transport.
    bad = tmp_path / "bad.py"
    bad.write_text("from ascend_dist.kv_mooncake.pull.scheduler import PullScheduler\n")
    assert "ascend_dist.kv_mooncake.pull.scheduler" in _imports(bad)
