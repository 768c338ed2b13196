"""Static import check: every import in a member's sources is something that member declares.

`uv` cannot stop a member from importing a sibling it does not depend on (a workspace venv has them all),
so this walks every module's AST, including imports inside functions, and checks:

- `ascend_dist.<x>` imports: the owning member is the importer itself or a declared dependency
  (`dependencies` or an extra);
- third-party imports: the distribution providing the top-level module (looked up in the current
  environment, which must be the full workspace venv) is declared. Modules that cannot be installed on
  this machine (CANN-only) must be listed in NATIVE_OPTIONAL with the reason they are allowed.

Exit status 1 on any undeclared import; each is printed with file and line.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from collections.abc import Mapping
from pathlib import Path

from _workspace import Member, dist_of_import, members, normalise

# Probed defensively and never installed on CPU machines; the import sits in a try/except.
NATIVE_OPTIONAL = {
    "torch_npu": "Ascend's torch backend, probed by ascend_dist.common.device (installed by ascend-dist[npu])",
    "acl": "CANN's Python runtime, only on Ascend hosts",
}


def imported_modules(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "ascend_dist":
                found.extend((f"ascend_dist.{alias.name}", node.lineno) for alias in node.names)
            else:
                found.append((node.module, node.lineno))
    return found


def check_member(member: Member, by_import: dict[str, str], providers: Mapping[str, list[str]]) -> list[str]:
    declared = member.requirement_names(extras=True) | {normalise(member.dist)}
    problems = []
    for path in sorted((member.folder / "src").rglob("*.py")):
        rel = path.relative_to(member.folder.parent.parent)
        for module, line in imported_modules(path):
            top = module.split(".")[0]
            if top == "ascend_dist":
                owner = dist_of_import(module, by_import)
                if owner is None:
                    problems.append(f"{rel}:{line}: {module} belongs to no workspace member")
                elif normalise(owner) not in declared:
                    problems.append(f"{rel}:{line}: imports {module} but {member.dist} does not declare {owner}")
            elif top in sys.stdlib_module_names or top == "__future__" or top in NATIVE_OPTIONAL:
                continue
            elif top not in providers:
                # Not installed in this venv (an optional extra such as vllm): the import name must
                # then be the declared distribution's own name.
                if normalise(top) not in declared:
                    problems.append(f"{rel}:{line}: {module} is neither installed here nor declared by {member.dist}")
            elif not {normalise(d) for d in providers[top]} & declared:
                problems.append(
                    f"{rel}:{line}: imports {module} (from {', '.join(providers[top])}) "
                    f"but {member.dist} does not declare it"
                )
    return problems


def main() -> int:
    all_members = members()
    by_import = {module: m.dist for m in all_members for module in m.imports}
    providers = importlib.metadata.packages_distributions()
    problems = [p for m in all_members for p in check_member(m, by_import, providers)]
    for problem in problems:
        print(f"check_imports: {problem}")
    if not problems:
        print(f"check_imports: ok ({len(all_members)} members)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
