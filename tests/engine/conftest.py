"""Fixtures of the engine tier: real vLLM engines (vLLM's CPU build) generating tokens.

Runs under the engine environment's Python (``nox -s engine``). One zygote serves the whole run;
models are written once; the reference engine (no connector) is shared. Engines with a connector
live as long as their module (or test, when a test kills one). Helpers are in
``ascend_dist.testing.engines`` (the ``ascend-dist-testing`` member, installed in the engine environment).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ascend_dist.cli.engines.host import Engine, EngineHost
from ascend_dist.cli.engines.wire import EngineSpec


@pytest.fixture(scope="session")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    with EngineHost(python=sys.executable, workdir=tmp_path_factory.mktemp("engines")) as h:
        yield h


@pytest.fixture(scope="session")
def models(host: EngineHost, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``a``: the model everyone serves; ``b``: other weights under the same name (the control's producer)."""
    root = tmp_path_factory.mktemp("models")
    return {
        "a": host.write_model(root / "a" / "tiny", seed=1),
        "b": host.write_model(root / "b" / "tiny", seed=2),
    }


@pytest.fixture(scope="session")
def reference(host: EngineHost, models: dict[str, Path]) -> Engine:
    """The same model without a connector: what every transfer must reproduce."""
    return host.spawn(EngineSpec(model=str(models["a"])), "reference")


_REPORT_KEY = pytest.StashKey[list[str]]()


@pytest.fixture(scope="session")
def engine_report(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """Adds a line to the engine tier's report (figures such as TTFT), printed at the end of the run."""
    lines = request.config.stash.setdefault(_REPORT_KEY, [])
    return lines.append


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    lines = config.stash.get(_REPORT_KEY, [])
    if lines:
        terminalreporter.section("engine tier report")
        for line in lines:
            terminalreporter.write_line(line)
