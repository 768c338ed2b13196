"""Reads a member's public surface from its source files (AST only: nothing is imported).

The surface of a published member is:

- every name in the `__all__` of each import package it owns (`ascend_dist.<member>`; the meta-package's
  `plugin`, `cli` and `parallel`), followed through re-exports (`from x import y`, lazy `TYPE_CHECKING`
  imports) to the module defining it;
- every class the vLLM plugin registers by module path (`Component(...)` in `ascend_dist.plugin`) that the
  member owns: users name those paths in `kv_connector_module_path`.

Each name is described by kind; functions by their parameters (name, kind, default or not, annotation text);
classes by their public methods, properties, fields and class attributes, with those of bases defined in the
workspace merged in. Reading source keeps the surface the same whatever is installed (vLLM, torch, CANN) and
works on any checkout, such as an old tag's tree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _workspace import Member, dist_of_import

PLUGIN_MODULE = "ascend_dist.plugin"
# Dunder methods that are part of how callers use a class.
PUBLIC_DUNDERS = frozenset({"__init__", "__call__", "__enter__", "__exit__", "__iter__", "__len__", "__getitem__"})
DATACLASS_BASES = frozenset({"Struct", "msgspec.Struct", "NamedTuple", "typing.NamedTuple", "TypedDict"})
_MAX_HOPS = 20  # re-export chains longer than this are a cycle


class SurfaceError(Exception):
    """The sources do not define what their `__all__` or the plugin names (the message says which)."""


@dataclass(frozen=True)
class Found:
    module: str
    node: ast.AST | None  # None: a submodule
    external: str | None = None  # a name imported from outside the workspace ("torch.Tensor")


class SourceIndex:
    """Module name -> parsed file, over every member's `src/` under one checkout root."""

    def __init__(self, root: Path) -> None:
        self._files: dict[str, Path] = {}
        for src in sorted(root.glob("packages/*/src")):
            for path in src.rglob("*.py"):
                parts = list(path.relative_to(src).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                self._files[".".join(parts)] = path
        self._trees: dict[str, ast.Module] = {}

    def has(self, module: str) -> bool:
        return module in self._files

    def is_package(self, module: str) -> bool:
        return module in self._files and self._files[module].name == "__init__.py"

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            if module not in self._files:
                raise SurfaceError(f"module {module} has no source file under packages/*/src")
            path = self._files[module]
            self._trees[module] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return self._trees[module]


def _top_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements bound at module level, including those under `if` (TYPE_CHECKING) and `try`."""
    found: list[ast.stmt] = []
    for stmt in body:
        found.append(stmt)
        if isinstance(stmt, ast.If):
            found.extend(_top_level(stmt.body) + _top_level(stmt.orelse))
        elif isinstance(stmt, ast.Try):
            found.extend(_top_level(stmt.body) + _top_level(stmt.orelse))
            for handler in stmt.handlers:
                found.extend(_top_level(handler.body))
    return found


def module_all(index: SourceIndex, module: str) -> list[str]:
    """The literal `__all__` of `module` (an empty list when it has none)."""
    for stmt in _top_level(index.tree(module).body):
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            value = getattr(stmt, "value", None)
            if not isinstance(value, ast.List | ast.Tuple) or not all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts
            ):
                raise SurfaceError(f"{module}.__all__ is not a literal list of strings")
            return [e.value for e in value.elts]  # type: ignore[attr-defined]
    return []


def _absolute(index: SourceIndex, module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if index.is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _binding(index: SourceIndex, module: str, stmt: ast.stmt, name: str) -> Found | tuple[str, str] | None:
    """What `stmt` binds to `name`: a definition, a re-export to follow (module, name), or None."""
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and stmt.name == name:
        return Found(module, stmt)
    if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
        return Found(module, stmt)
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
        return Found(module, stmt)
    if isinstance(stmt, ast.ImportFrom):
        for alias in stmt.names:
            if (alias.asname or alias.name) == name:
                return (_absolute(index, module, stmt), alias.name)
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.asname == name:
                return Found(module, None, external=alias.name)
    return None


def resolve(index: SourceIndex, module: str, name: str) -> Found:
    """Follow `module.name` through re-exports to its definition."""
    for _ in range(_MAX_HOPS):
        bound: Found | tuple[str, str] | None = None
        for stmt in _top_level(index.tree(module).body):
            bound = _binding(index, module, stmt, name) or bound  # the last binding wins, as at run time
        if isinstance(bound, Found):
            return bound
        if bound is None:
            if index.has(f"{module}.{name}"):
                return Found(f"{module}.{name}", None)
            raise SurfaceError(f"{module} does not define {name!r}")
        source, source_name = bound
        if not index.has(source) and not index.has(f"{source}.{source_name}"):
            return Found(module, None, external=f"{source}.{source_name}")
        if not index.has(source):
            return Found(f"{source}.{source_name}", None)
        module, name = source, source_name
    raise SurfaceError(f"{module}.{name}: re-export chain longer than {_MAX_HOPS}")


def _text(node: ast.AST | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _param(arg: ast.arg, prefix: str = "", default: bool = False) -> str:
    text = prefix + arg.arg + (f": {ast.unparse(arg.annotation)}" if arg.annotation is not None else "")
    return text + (" = ..." if default else "")


def describe_function(node: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    """Parameters as signature text, one per entry, with Python's `/` and `*` markers; defaults as `= ...`."""
    args = node.args
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    params = [_param(arg, default=i >= first_default) for i, arg in enumerate(positional)]
    if args.posonlyargs:
        params.insert(len(args.posonlyargs), "/")
    if args.vararg:
        params.append(_param(args.vararg, "*"))
    elif args.kwonlyargs:
        params.append("*")
    params += [_param(a, default=d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        params.append(_param(args.kwarg, "**"))
    decorators = sorted({ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in node.decorator_list})
    kind = "property" if "property" in decorators or "cached_property" in decorators else "function"
    described: dict[str, Any] = {"kind": kind, "params": params, "returns": _text(node.returns)}
    if isinstance(node, ast.AsyncFunctionDef):
        described["async"] = True
    if {"staticmethod", "classmethod"} & set(decorators):
        described["binding"] = "staticmethod" if "staticmethod" in decorators else "classmethod"
    return described


def parse_params(params: list[str]) -> list[dict[str, Any]]:
    """The structured form of `describe_function`'s parameter text (name, kind, whether it has a default)."""
    parsed = []
    kind = "positional_only" if "/" in params else "positional_or_keyword"
    for text in params:
        if text == "/":
            kind = "positional_or_keyword"
            continue
        if text == "*":
            kind = "keyword_only"
            continue
        name = text.split(":", 1)[0].split(" = ", 1)[0].strip()
        if name.startswith("**"):
            parsed.append({"name": name[2:], "kind": "var_keyword", "default": True})
        elif name.startswith("*"):
            parsed.append({"name": name[1:], "kind": "var_positional", "default": True})
            kind = "keyword_only"
        else:
            parsed.append({"name": name, "kind": kind, "default": text.endswith(" = ...")})
    return parsed


def _is_public(name: str) -> bool:
    return not name.startswith("_") or name in PUBLIC_DUNDERS


def _class_body(node: ast.ClassDef) -> dict[str, Any]:
    methods: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    attributes: list[str] = []
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and _is_public(stmt.name):
            methods[stmt.name] = describe_function(stmt)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and _is_public(stmt.target.id):
            fields[stmt.target.id] = {"annotation": _text(stmt.annotation), "default": stmt.value is not None}
        elif isinstance(stmt, ast.Assign):
            attributes.extend(t.id for t in stmt.targets if isinstance(t, ast.Name) and _is_public(t.id))
    return {"methods": methods, "fields": fields, "attributes": attributes}


def describe_class(index: SourceIndex, module: str, node: ast.ClassDef, depth: int = 0) -> dict[str, Any]:
    """A class with the public members of its workspace-defined bases merged in (its own win)."""
    merged: dict[str, Any] = {"methods": {}, "fields": {}, "attributes": []}
    for base in node.bases:
        if depth < _MAX_HOPS and isinstance(base, ast.Name):
            try:
                found = resolve(index, module, base.id)
            except SurfaceError:
                continue
            if isinstance(found.node, ast.ClassDef):
                inherited = describe_class(index, found.module, found.node, depth + 1)
                for key in ("methods", "fields"):
                    merged[key].update(inherited[key])
                merged["attributes"] += inherited["attributes"]
    own = _class_body(node)
    merged["methods"].update(own["methods"])
    merged["fields"].update(own["fields"])
    merged["attributes"] = sorted(set(merged["attributes"] + own["attributes"]))
    bases = [ast.unparse(b) for b in node.bases]
    decorators = {ast.unparse(d).split("(")[0].rsplit(".", 1)[-1] for d in node.decorator_list}
    field_init = "dataclass" in decorators or any(b in DATACLASS_BASES for b in bases)
    return {"kind": "class", "bases": bases, "field_init": field_init, **merged}


def describe(index: SourceIndex, found: Found) -> dict[str, Any]:
    node = found.node
    if found.external is not None:
        return {"kind": "reexport", "of": found.external}
    if node is None:
        return {"kind": "module", "module": found.module}
    if isinstance(node, ast.ClassDef):
        return describe_class(index, found.module, node)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return describe_function(node)
    annotation = node.annotation if isinstance(node, ast.AnnAssign) else None
    return {"kind": "constant", "annotation": _text(annotation)}


def plugin_components(index: SourceIndex) -> list[tuple[str, str]]:
    """(module, class) of every `Component(...)` the plugin declares, read from its source."""
    if not index.has(PLUGIN_MODULE):
        return []
    found = []
    for node in ast.walk(index.tree(PLUGIN_MODULE)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Component":
            values = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if len(values) == 4:
                found.append((values[2], values[3]))
    return sorted(set(found))


def member_surface(root: Path, member: Member, every: list[Member]) -> dict[str, Any]:
    """`module:name` -> description, for everything `member` promises its users."""
    index = SourceIndex(root)
    entries: dict[str, Any] = {}
    for module in member.imports:
        for name in module_all(index, module):
            entries[f"{module}:{name}"] = describe(index, resolve(index, module, name))
    by_import = {m: other.dist for other in every for m in other.imports}
    for module, cls in plugin_components(index):
        if dist_of_import(module, by_import) == member.dist:
            entries[f"{module}:{cls}"] = describe(index, resolve(index, module, cls))
    return dict(sorted(entries.items()))
