"""The README's install matrix: who installs what, and what each install must bring.

The README's table lists these rows' commands (a test compares them); the `wheels` nox session runs each row
in a fresh venv from the wheels it built, with every one of our distribution names pinned to its wheel file
(a sibling never resolves to a same-named package on an index). A row brings exactly `ours` of our
distributions, at least `also` of the third-party ones, and its imports work. Rows whose hardware packages
cannot run here (CUDA's Mooncake build, torch-npu without CANN) are resolved in the fresh venv
(`uv pip install --dry-run`) instead of installed; the README says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from _workspace import members, normalise

PUBLISHED = tuple(sorted(m.dist for m in members() if not m.is_private))
ALL_IMPORTS = tuple(i for m in members() if not m.is_private for i in m.imports)
RL_TRAINER = ("ascend-dist-common", "ascend-dist-hccl-ctypes", "ascend-dist-weight-transfer")


@dataclass(frozen=True)
class InstallRow:
    who: str
    requirement: str  # what `pip install` is given
    ours: tuple[str, ...]  # our distributions the install brings, and no other
    also: tuple[str, ...] = ()  # third-party distributions it must bring (the hardware's)
    imports: tuple[str, ...] = ()  # checked after a real install
    install: bool = True  # False: resolved in the fresh venv (--dry-run), not installed
    why_resolved_only: str = ""

    @property
    def command(self) -> str:
        return f"pip install '{self.requirement}'" if "[" in self.requirement else f"pip install {self.requirement}"


ROWS = (
    InstallRow(
        "RL framework, trainer process",
        "ascend-dist-weight-transfer",
        RL_TRAINER,
        also=("torch",),
        imports=("ascend_dist.weight_transfer.trainer", "ascend_dist.weight_transfer.ipc_trainer"),
    ),
    InstallRow(
        "RL framework, its vLLM engines (beside their vLLM)",
        "ascend-dist[weight-transfer]",
        ("ascend-dist", *RL_TRAINER),
        imports=("ascend_dist.plugin", "ascend_dist.weight_transfer.worker"),
    ),
    InstallRow(
        "operator, CPU (Mooncake over TCP)",
        "ascend-dist[all,cpu]",
        PUBLISHED,
        also=("mooncake-transfer-engine-non-cuda",),
        imports=ALL_IMPORTS,
    ),
    InstallRow(
        "operator, CUDA",
        "ascend-dist[all,cuda]",
        PUBLISHED,
        also=("mooncake-transfer-engine",),
        install=False,
        why_resolved_only="the CUDA Mooncake build needs the CUDA runtime",
    ),
    InstallRow(
        "operator, NPU (Ascend)",
        "ascend-dist[all,npu]",
        PUBLISHED,
        also=("torch-npu", "mooncake-transfer-engine-npu", "memfabric-hybrid"),
        install=False,
        why_resolved_only="torch-npu breaks `import torch` without CANN",
    ),
)

# `uv pip install --dry-run` lists what it would install as ` + name==version` or ` + name @ url`.
_WOULD_INSTALL = re.compile(r"^\s*\+\s+([A-Za-z0-9][A-Za-z0-9._-]*)", re.MULTILINE)


def would_install(dry_run_output: str) -> set[str]:
    return {normalise(name) for name in _WOULD_INSTALL.findall(dry_run_output)}


def row_problems(row: InstallRow, installed: set[str]) -> list[str]:
    """What is wrong with the set of distributions an install of `row` brought (normalised names)."""
    ours_now = {d for d in installed if d == "ascend-dist" or d.startswith("ascend-dist-")}
    expected = {normalise(d) for d in row.ours}
    problems = []
    if ours_now != expected:
        missing, extra = sorted(expected - ours_now), sorted(ours_now - expected)
        problems.append(f"{row.who}: `{row.command}` brought our {sorted(ours_now)} (missing {missing}, extra {extra})")
    missing_also = sorted({normalise(d) for d in row.also} - installed)
    if missing_also:
        problems.append(f"{row.who}: `{row.command}` did not bring {missing_also}")
    return problems
