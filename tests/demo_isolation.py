"""Which library modules exist, which need vLLM, and what importing each one pulls in.

Helpers of `test_demo_isolation.py` (no tests here). Modules are found on disk through the
`ascend_dist` namespace path, never by importing them, so the pytest process stays clean; each
import is measured in a child process that has loaded no `ascend_dist` module before.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

# The `ascend-dist` command's job is to run the demos: it imports the scenario contract and
# discovers scenarios at run time, so it is no library module.
NOT_LIBRARY = ("ascend_dist.cli",)
# Third-party modules whose import means the module needs the pinned vLLM environment.
VLLM_ROOTS = ("vllm", "torch_npu")


def is_demo(name: str) -> bool:
    """Whether a module name is demo/bench code: a `_demo` part, a scenario or a synthetic model."""
    parts = name.split(".")
    if not name.startswith("ascend_dist."):
        return False
    return any(p.startswith("_demo") or p.startswith("scenario") or "synthetic" in p for p in parts[1:])


def _walk(path: list[str], prefix: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for info in pkgutil.iter_modules(path, prefix):
        where = Path(info.module_finder.path) / info.name.rpartition(".")[2]  # type: ignore[union-attr]
        if info.ispkg:
            found[info.name] = where / "__init__.py"
            found.update(_walk([str(where)], info.name + "."))
        else:
            found[info.name] = where.with_suffix(".py")
    return found


def all_modules() -> dict[str, Path]:
    """Every module under the `ascend_dist` namespace: dotted name -> source file."""
    spec = importlib.util.find_spec("ascend_dist")
    assert spec is not None and spec.submodule_search_locations is not None
    return _walk(list(spec.submodule_search_locations), "ascend_dist.")


def library_modules(modules: dict[str, Path]) -> list[str]:
    """The public library modules: no part starts with `_` (so no `_demo`), none is the CLI."""
    return sorted(
        name
        for name in modules
        if not any(p.startswith("_") for p in name.split(".")[1:])
        and not name.startswith(NOT_LIBRARY)
        and not is_demo(name)
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_names(tree: ast.Module) -> set[str]:
    """Modules a file imports when it is imported: not in functions, not under `if TYPE_CHECKING`."""
    names: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.If):
            todo.extend(node.orelse if _is_type_checking(node.test) else node.body + node.orelse)
        elif isinstance(node, ast.Try):
            todo.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                todo.extend(handler.body)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            todo.extend(node.body)
    return names


def needs_vllm(modules: dict[str, Path]) -> set[str]:
    """Modules whose import reaches vLLM (or torch_npu), directly or through other ascend_dist modules."""
    edges: dict[str, set[str]] = {}
    direct: set[str] = set()
    for name, path in modules.items():
        imported = _import_time_names(ast.parse(path.read_text(encoding="utf-8")))
        if any(i.split(".")[0] in VLLM_ROOTS for i in imported):
            direct.add(name)
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count("."))}
        edges[name] = {
            m
            for i in imported
            for m in {i, *(i.rsplit(".", k)[0] for k in range(1, i.count(".")))}
            if m in modules and m != name
        } | (parents & modules.keys())
    reach = set(direct)
    changed = True
    while changed:
        changed = False
        for name, deps in edges.items():
            if name not in reach and deps & reach:
                reach.add(name)
                changed = True
    return reach


# Runs in the child: heavy third-party modules first (they hold no demo code), then one fork per
# module, so every module is imported by a process that has loaded no ascend_dist module yet.
_PROBE = r"""
import importlib, json, os, sys
for heavy in json.loads(sys.argv[2]):
    try:
        importlib.import_module(heavy)
    except ImportError:
        pass
assert not [m for m in sys.modules if m.startswith("ascend_dist.")]
results = {}
for name in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            out = {"loaded": sorted(m for m in sys.modules if m.startswith("ascend_dist."))}
        except BaseException as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        with os.fdopen(write, "w") as f:
            json.dump(out, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    results[name] = json.loads(text) if text else {"error": "the import killed the process"}
print(json.dumps(results))
"""


HEAVY = ("numpy", "msgspec", "torch", "zmq")


def probe(names: list[str], timeout_s: float, preload: tuple[str, ...] = HEAVY) -> dict[str, dict[str, object]]:
    """For each module: the ascend_dist modules its import loaded, or the error it raised.

    `preload` (third-party only) is imported once before the forks, so each child pays only for ours.
    """
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(names), json.dumps(preload)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
