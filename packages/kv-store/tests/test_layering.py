"""The package's dependency direction, read from the sources' import statements (``ast``).

config <- keys <- {scheduler, lookup, transfer}; backends/ import only config/ (and
ascend_dist.common); scheduler/, lookup/ and transfer/ never import each other, except the one
edge in ``EXCEPTIONS``; what the scheduler hands the workers is the top-level `step_metadata`,
which both may import; no sub-package imports another top-level module (the composition root
`assembly`, the vLLM adapters, the package ``__init__``); nothing outside _demo/ imports _demo/;
only the vLLM-facing modules import vLLM (at module level or not).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from ascend_dist import kv_store

SRC = Path(__file__).parents[1] / "src" / "ascend_dist" / "kv_store"
PREFIX = "ascend_dist.kv_store"
SUBPACKAGES = ("config", "keys", "scheduler", "lookup", "transfer", "backends")

# What each sub-package may import from the package (itself included).
ALLOWED: dict[str, frozenset[str]] = {
    "config": frozenset({"config"}),
    "keys": frozenset({"config", "keys"}),
    "backends": frozenset({"config", "backends"}),
    "scheduler": frozenset({"config", "keys", "scheduler", "step_metadata"}),
    "lookup": frozenset({"config", "keys", "backends", "lookup"}),
    "transfer": frozenset({"config", "keys", "backends", "transfer", "step_metadata"}),
    "step_metadata": frozenset(),
}
# (importing module, imported module): the documented crossings between scheduler/lookup/transfer.
EXCEPTIONS = frozenset(
    {
        # The rank-0 worker answers the scheduler's lookups from its own backend.
        ("transfer/worker.py", f"{PREFIX}.lookup.pool_lookup"),
    }
)
# _demo/vllm_driver.py: the pool-vllm bench's driver of vLLM's Scheduler (demo code, never imported by the library)
VLLM_MODULES = frozenset(
    {"vllm_connector.py", "vllm_spec.py", "vllm_buffers.py", "assembly.py", "_demo/vllm_driver.py"}
)


def _imports(tree: ast.AST) -> set[str]:
    """Absolute names imported anywhere in ``tree``; ``from pkg import mod`` also yields ``pkg.mod``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add("." * node.level + (node.module or ""))  # relative: refused below
            elif node.module:
                names.add(node.module)
                if node.module == PREFIX:
                    names.update(f"{PREFIX}.{alias.name}" for alias in node.names)
    return names


def _area(rel: str) -> str:
    """``config`` for ``config/sizes.py``; the module name for a top-level module (``step_metadata``)."""
    parts = rel.split("/")
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _target(name: str) -> str:
    """The area an import of ours lands in (``__init__`` for the package itself)."""
    if name == PREFIX:
        return "__init__"
    return name.removeprefix(PREFIX + ".").split(".")[0]


def violations(rel: str, imported: set[str]) -> list[str]:
    """Every broken rule in module ``rel`` (a path under the package) importing ``imported``."""
    area = _area(rel)
    found: list[str] = []
    for name in sorted(imported):
        if name.startswith("."):
            found.append(f"{rel}: relative import {name!r} (write the absolute path)")
            continue
        if (name == "vllm" or name.startswith("vllm.")) and rel not in VLLM_MODULES:
            found.append(f"{rel}: imports vLLM ({name})")
        if name != PREFIX and not name.startswith(PREFIX + "."):
            continue
        target = _target(name)
        if area == "_demo":
            continue
        if target == "_demo":
            found.append(f"{rel}: library code imports the demo package ({name})")
        elif area in ALLOWED and target not in ALLOWED[area] and (rel, name) not in EXCEPTIONS:
            found.append(f"{rel}: {area} may not import {target} ({name})")
    return found


def _modules() -> list[str]:
    return sorted(p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_rules_see_every_area() -> None:
    # A rename that empties an area would make every rule below pass vacuously.
    areas = {_area(rel) for rel in _modules()}
    assert {*SUBPACKAGES, "_demo", "step_metadata", "assembly", "vllm_connector"} <= areas
    for importer, imported in EXCEPTIONS:
        assert (SRC / importer).is_file()
        assert imported in _imports(ast.parse((SRC / importer).read_text())), f"stale exception {importer}"


@pytest.mark.parametrize("rel", _modules())
def test_module_imports_follow_the_dependency_direction(rel: str) -> None:
    tree = ast.parse((SRC / rel).read_text(), filename=rel)
    assert violations(rel, _imports(tree)) == []


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        ("config/sizes.py", "from ascend_dist.kv_store.keys.keys import KeyMetadata"),
        ("keys/keys.py", "from ascend_dist.kv_store.scheduler.plan import RequestTracker"),
        ("backends/gva.py", "from ascend_dist.kv_store.keys import token_db"),
        ("scheduler/scheduler.py", "from ascend_dist.kv_store.transfer.worker import KVPoolWorker"),
        ("scheduler/plan.py", "import ascend_dist.kv_store.lookup.lookup_rpc"),
        ("lookup/pool_lookup.py", "from ascend_dist.kv_store.transfer.events import EventCollector"),
        ("transfer/layerwise.py", "from ascend_dist.kv_store.lookup.pool_lookup import PoolLookup"),
        ("transfer/worker.py", "from ascend_dist.kv_store.scheduler.plan import MambaGroups"),
        ("transfer/chunk_plan.py", "from ascend_dist.kv_store import assembly"),
        ("keys/token_db.py", "from ascend_dist.kv_store import KeyMetadata"),
        ("step_metadata.py", "from ascend_dist.kv_store.config.sizes import cdiv"),
        ("assembly.py", "from ascend_dist.kv_store._demo.scenario import make_scenario"),
        ("transfer/gate.py", "if True:\n    import vllm.config"),
        ("keys/rekey.py", "from .token_db import GroupBuffers"),
    ],
)
def test_a_violation_is_seen(rel: str, source: str) -> None:
    # The control: each parsed violating import (in a module's place) is reported.
    assert violations(rel, _imports(ast.parse(source))) != []


def test_the_documented_exception_is_that_edge_only() -> None:
    allowed = "from ascend_dist.kv_store.lookup.pool_lookup import PoolLookup"
    assert violations("transfer/worker.py", _imports(ast.parse(allowed))) == []
    other = "from ascend_dist.kv_store.lookup.lookup_rpc import LookupServer"
    assert violations("transfer/worker.py", _imports(ast.parse(other))) != []


def test_every_lazy_package_name_resolves() -> None:
    # The package's lazy names point at module paths by string: a move must carry them along.
    for name in kv_store.__all__:
        module = importlib.import_module(kv_store._LAZY[name])  # pyright: ignore[reportPrivateUsage]
        assert getattr(module, name) is getattr(kv_store, name), name
