"""Checks the workspace layout rules (docs/architecture.md#layout).

- `ascend_dist` is a PEP 420 namespace: no member ships `src/ascend_dist/__init__.py`;
- folder `packages/x-y` <-> distribution `ascend-dist-x-y` <-> import `ascend_dist.x_y` (the meta-package
  `ascend-dist` owns `ascend_dist.plugin` and `ascend_dist.cli`);
- each import package has `__init__.py` and `py.typed`; each member has README.md, CHANGELOG.md, tests/,
  a static version and a `test` dependency group;
- a private member (classifier `Private :: Do Not Upload`, the tests' helpers) is required by no member's
  dependencies or extras: only `test` groups and the workspace's dev group may take it.

With `--installed`, checks the current environment instead: every published member distribution is installed
from a wheel, each import package resolves, and the vLLM plugin entry point points at an importable callable.

Exit status 1 when any rule is broken; every problem is printed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

from _workspace import members, normalise


def check_private_unrequired() -> list[str]:
    """A private member may sit in `test` groups and the dev group only, never in what a library requires."""
    private = {normalise(m.dist) for m in members() if m.is_private}
    return [
        f"{m.folder.relative_to(m.folder.parent.parent)}: requires {name}, a private member (only `test` groups may)"
        for m in members()
        for name in sorted(m.requirement_names(extras=True) & private)
    ]


def check_sources() -> list[str]:
    problems: list[str] = check_private_unrequired()
    for member in members():
        where = member.folder.relative_to(member.folder.parent.parent)
        if member.dist != member.expected_dist:
            problems.append(f"{where}: distribution is {member.dist!r}, expected {member.expected_dist!r}")
        if (member.folder / "src/ascend_dist/__init__.py").exists():
            problems.append(f"{where}: src/ascend_dist/__init__.py exists; ascend_dist is a PEP 420 namespace")
        for module in member.imports:
            pkg = member.folder / "src" / module.replace(".", "/")
            for required in ("__init__.py", "py.typed"):
                if not (pkg / required).is_file():
                    problems.append(f"{where}: {pkg.relative_to(member.folder)}/{required} is missing")
        for required in ("README.md", "CHANGELOG.md", "tests"):
            if not (member.folder / required).exists():
                problems.append(f"{where}: {required} is missing")
        project = member.pyproject["project"]
        if "version" not in project or "version" in project.get("dynamic", []):
            problems.append(f"{where}: the version must be static (uv cannot bump dynamic versions)")
        if "test" not in member.pyproject.get("dependency-groups", {}):
            problems.append(f"{where}: no `test` dependency group (nox tests-<member> syncs it)")
        wheel = member.pyproject.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {})
        if wheel.get("packages") != ["src/ascend_dist"]:
            problems.append(f"{where}: [tool.hatch.build.targets.wheel] packages must be ['src/ascend_dist']")
    return problems


def check_installed() -> list[str]:
    problems: list[str] = []
    for member in members():
        if member.is_private:
            continue  # never published, so not part of what a user installs
        try:
            importlib.metadata.distribution(member.dist)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{member.dist} is not installed")
            continue
        for module in member.imports:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                problems.append(f"{member.dist}: import {module} failed: {exc}")
    plugins = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "ascend_dist"]
    if len(plugins) != 1:
        problems.append(f"vllm.general_plugins has {len(plugins)} entries named ascend_dist, expected 1")
    else:
        try:
            if not callable(plugins[0].load()):
                problems.append(f"plugin entry point {plugins[0].value} is not callable")
        except ImportError as exc:
            problems.append(f"plugin entry point {plugins[0].value} does not load: {exc}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--installed", action="store_true", help="check the installed wheels instead of sources")
    args = parser.parse_args()
    problems = check_installed() if args.installed else check_sources()
    for problem in problems:
        print(f"check_layout: {problem}")
    if not problems:
        print("check_layout: ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
