"""Entry point of the `ascend-dist` command."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ascend_dist.cli.native_logs import NATIVE_LOGS_ENV, NativeLogFilter

if TYPE_CHECKING:
    from ascend_dist.common.scenarios import Scenario

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command's argument parser: `doctor`, `secret`, `demo`, `bench`."""
    parser = argparse.ArgumentParser(
        prog="ascend-dist", description="Distributed communication for vLLM on Ascend NPUs."
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="log at INFO level to stderr, and let native libraries' own log lines (Mooncake's) through",
    )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="report what is installed and usable, with fixes")
    doctor.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    doctor.add_argument("--host", default="127.0.0.1", help="the node's configured host (fills in the port table)")
    doctor.add_argument("--kv-port", type=int, default=None, help="the node's kv_port (fills in the port table)")

    secret = sub.add_parser("secret", help="create the deployment secret that authenticates peers")
    secret.add_argument(
        "--write", metavar="PATH", required=True,
        help="create PATH (it must not exist) holding a fresh random key, mode 0600; point "
        "ASCEND_DIST_SECRET_FILE at a copy of it on every node",
    )  # fmt: skip

    for mode, text in (
        ("demo", "run every subsystem end to end on loopback, verified byte for byte"),
        ("bench", "measure each figure beside its raw-engine baseline from the same run"),
    ):
        cmd = sub.add_parser(mode, help=text)
        cmd.add_argument("scenarios", nargs="*", help="scenario names (default: all installed)")
        cmd.add_argument("--list", action="store_true", help="list the installed scenarios and exit")
        cmd.add_argument("--quick", action="store_true", help="small sizes, for a fast smoke run")
        cmd.add_argument("--json", metavar="PATH", help="also write the results as JSON")
        cmd.add_argument(
            "--engine",
            choices=("synthetic", "vllm"),
            default="synthetic",
            help="synthetic: our scheduler and worker code around a synthetic model (default); vllm: real vLLM "
            "engines (the CPU build) generating tokens, run under $ASCEND_DIST_ENGINE_PYTHON",
        )
        if mode == "demo":
            cmd.add_argument(
                "--serve",
                action="store_true",
                help="pd only: P and D under `vllm serve` (the CPU build) behind a small proxy, checked against a "
                "plain engine; prints the commands it ran and D's transfer stats from /metrics (implies --engine vllm)",
            )
        if mode == "bench":
            cmd.add_argument(
                "--repeat", type=int, default=3, help="timed repetitions per figure (each scenario summarises them)"
            )
    return parser


def _discover(engine: str) -> Callable[[], tuple[dict[str, Scenario], dict[str, str]]]:
    """Where the scenarios come from: installed entry points, the real-engine ones, or the `vllm serve` one."""
    if engine == "serve":
        from ascend_dist.cli.engines.serve_demo import serve_scenarios

        return serve_scenarios
    if engine == "vllm":
        from ascend_dist.cli.engines.demo import engine_scenarios

        return engine_scenarios
    from ascend_dist.common.scenarios import discover_scenarios

    return discover_scenarios


def _list(mode: str, engine: str) -> int:
    from ascend_dist.cli.render import render_table

    available, broken = _discover(engine)()
    rows = [(s.name, s.summary) for s in available.values() if mode in s.modes]
    print(render_table(("scenario", "what it does"), rows) if rows else f"no {mode} scenarios are installed")
    for name, reason in broken.items():
        print(f"warning: scenario {name} could not be loaded: {reason}")
    return 0


def _native_log_path() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ascend-dist" / "logs" / f"native-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


def main(argv: Sequence[str] | None = None, *, divert_native_logs: bool | None = None) -> int:
    """Run the command; returns the process exit status.

    `divert_native_logs` (default: only when run as the console script, `argv` None) puts the
    `NativeLogFilter` behind descriptor 2 for the rest of the process; in-process callers keep their stderr.
    """
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr)
    divert = argv is None if divert_native_logs is None else divert_native_logs
    if not divert or args.verbose or os.environ.get(NATIVE_LOGS_ENV, "") not in ("", "0"):
        return _run(args)
    with NativeLogFilter(_native_log_path(), quiet_after_exit=True) as native:
        status = _run(args)
        sys.stdout.flush()
        if native.diverted:
            # Our line, written through the filter, so it is ordered after the command's own output.
            print(
                f"ascend-dist: native libraries' log lines (Mooncake's) are in {native.log_path}; "
                f"-v or {NATIVE_LOGS_ENV}=1 shows them here",
                file=sys.stderr,
            )
    return status


def _run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        from ascend_dist.cli.doctor import run_doctor

        return run_doctor(json_path=args.json, host=args.host, kv_port=args.kv_port)
    if args.command == "secret":
        return _write_secret(args.write)
    engine = "serve" if getattr(args, "serve", False) else args.engine
    if args.list:
        return _list(args.command, engine)
    from ascend_dist.cli.runner import run_scenarios

    if args.command == "bench" and args.repeat < 1:
        print("--repeat must be at least 1", file=sys.stderr)
        return 2
    from ascend_dist.cli.demo_secret import demo_secret

    # Demos and benches run the deployment as it should run: peers authenticated (the bench's figures
    # include what that costs, and the pd bench shows it beside the transfer time).
    with demo_secret() as source:
        print(f"peer authentication on: every side-channel frame is MAC'ed with {source}", file=sys.stderr)
        return run_scenarios(
            args.command,
            args.scenarios,
            quick=args.quick,
            repeat=getattr(args, "repeat", 1),
            json_path=args.json,
            discover=_discover(engine),
        )


def _write_secret(path: str) -> int:
    from ascend_dist.common.secret import SECRET_FILE_ENV, write_secret_file

    try:
        write_secret_file(Path(path))
    except OSError as exc:  # exists already, no such folder, not writable: say which
        print(f"cannot create {path}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"wrote a new deployment secret to {path} (mode 0600); set {SECRET_FILE_ENV}={path} on every node")
    return 0


if __name__ == "__main__":
    sys.exit(main())
