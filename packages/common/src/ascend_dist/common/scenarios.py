"""The contract between the `ascend-dist demo`/`bench` commands and the scenarios members contribute.

Runs in: the `ascend-dist` command's process (scenarios may start their own child processes).

A member contributes a scenario by naming a zero-argument factory in its pyproject::

    [project.entry-points."ascend_dist.scenarios"]
    pd = "ascend_dist.kv_mooncake._demo.scenario_pd:make_scenario"

The command discovers every installed scenario through that entry-point group, so adding one never
edits the command. A scenario checks what it moved byte for byte (`Check`) and, in bench mode,
reports each figure next to a baseline measured in the same run (`Measurement`), because absolute
numbers on a shared 2-core machine are noise while ratios survive.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from ascend_dist.common.errors import ConfigError

__all__ = [
    "ENTRY_POINT_GROUP",
    "Check",
    "Measurement",
    "Mode",
    "Progress",
    "Scenario",
    "ScenarioContext",
    "ScenarioReport",
    "discover_scenarios",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "ascend_dist.scenarios"
Mode = Literal["demo", "bench"]


@dataclass(frozen=True)
class Check:
    """One verified fact, e.g. "layer 3 K bytes equal on D"."""

    name: str
    ok: bool
    detail: str = ""


@dataclass(frozen=True)
class Measurement:
    """One benchmark figure beside its baseline from the same run.

    `value` and `baseline` share `unit`. `higher_is_better` decides the direction of `ratio`, which is
    always "how many times better than the baseline" (above 1 means we win).
    """

    name: str
    value: float
    unit: str
    baseline: float
    baseline_name: str
    higher_is_better: bool = True
    target_ratio: float | None = None

    @property
    def ratio(self) -> float:
        """How many times better than the baseline (inf when the baseline is zero)."""
        if self.higher_is_better:
            return self.value / self.baseline if self.baseline else float("inf")
        return self.baseline / self.value if self.value else float("inf")

    @property
    def meets_target(self) -> bool | None:
        """Whether the ratio reaches `target_ratio`; None when no target is set."""
        return None if self.target_ratio is None else self.ratio >= self.target_ratio


@dataclass
class ScenarioReport:
    """What one scenario run found: its checks, its measurements and its wall time."""

    scenario: str
    mode: Mode
    checks: list[Check] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the run raised nothing and every check passed."""
        return self.error is None and all(c.ok for c in self.checks)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record a check and return its outcome, so callers can branch on it."""
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)


class Progress(Protocol):
    """Where a long scenario reports progress; the command prints it with elapsed time."""

    def step(self, message: str) -> None:
        """Announce the next phase."""
        ...

    def advance(self, done: int, total: int) -> None:
        """Report `done` of `total` units of the current phase."""
        ...


@dataclass(frozen=True)
class ScenarioContext:
    """What the command hands a scenario: the mode, the progress sink and the size knob."""

    mode: Mode
    progress: Progress
    quick: bool = False
    repeat: int = 3


@runtime_checkable
class Scenario(Protocol):
    """A demo/bench scenario. `modes` says which of the two commands list it."""

    name: str
    summary: str
    modes: frozenset[str]

    def run(self, ctx: ScenarioContext) -> ScenarioReport:
        """Run once and report; must clean up every process and socket it started, even on failure."""
        ...


def discover_scenarios(
    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
) -> tuple[dict[str, Scenario], dict[str, str]]:
    """Load every scenario registered under `ascend_dist.scenarios`.

    Args:
        entry_points: the entry points to load; defaults to the installed ones (injectable for tests).

    Returns:
        (scenarios by name, load failures by entry-point name with the reason). A broken scenario never
        hides the others.

    Raises:
        ConfigError: two scenarios claim the same name.
    """
    eps = entry_points if entry_points is not None else importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    found: dict[str, Scenario] = {}
    broken: dict[str, str] = {}
    for ep in sorted(eps, key=lambda e: e.name):
        try:
            factory: Callable[[], Scenario] = ep.load()
            scenario = factory()
        except Exception as exc:  # a third-party plugin may raise anything; report it, keep going
            logger.warning("scenario %s (%s) failed to load: %s", ep.name, ep.value, exc)
            broken[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        if not isinstance(scenario, Scenario):
            broken[ep.name] = f"{ep.value} did not return a Scenario"
            continue
        if scenario.name in found:
            raise ConfigError("scenario name", scenario.name, "a name no other installed scenario uses")
        found[scenario.name] = scenario
    return found, broken
