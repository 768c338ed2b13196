"""What `ascend-dist doctor` looks at: one probe per part, each returning a `Finding` with a fix hint.

Runs in: the `ascend-dist` command's process. Native engines are probed in a child process with a
deadline, so a crashing or hanging native library cannot take the command down with it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

from ascend_dist.common.device.detect import select_backend
from ascend_dist.common.errors import AscendDistError

__all__ = [
    "MEMBERS",
    "MOONCAKE_VARIANTS",
    "Finding",
    "probe_backend",
    "probe_libibverbs",
    "probe_members",
    "probe_mooncake",
    "probe_python_deps",
    "probe_torch",
    "probe_vllm",
]

Status = Literal["ok", "warn", "missing"]

MEMBERS = (
    "ascend-dist",
    "ascend-dist-common",
    "ascend-dist-hccl-ctypes",
    "ascend-dist-kv-mooncake",
    "ascend-dist-kv-store",
    "ascend-dist-kv-offload",
    "ascend-dist-eplb-ascend",
    "ascend-dist-weight-transfer",
)
# All install the same `mooncake` module; which one is present decides the usable protocols.
MOONCAKE_VARIANTS = (
    "mooncake-transfer-engine-non-cuda",
    "mooncake-transfer-engine",
    "mooncake-transfer-engine-npu",
)
# Members that cannot work without a Mooncake engine: with one installed, Mooncake becomes required.
MOONCAKE_USERS = ("ascend-dist-kv-mooncake", "ascend-dist-kv-store")
PINNED_TORCH = "2.14.0"
PINNED_VLLM = "0.33.0"
ENGINE_PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's report."""

    part: str
    status: Status
    detail: str
    fix: str = ""
    required: bool = False

    @property
    def blocking(self) -> bool:
        """A required part that is not usable: the doctor exits non-zero."""
        return self.required and self.status == "missing"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe_backend() -> Finding:
    """Which device backend this process would use, and why."""
    try:
        choice = select_backend()
    except AscendDistError as exc:
        return Finding("device backend", "missing", str(exc), "set ASCEND_DIST_DEVICE to npu, cuda or cpu", True)
    return Finding("device backend", "ok", f"{choice.name} ({choice.reason})", required=True)


def probe_torch() -> Finding:
    """Torch must be installed; the workspace pins the version vLLM and torch-npu share."""
    version = _version("torch")
    if version is None:
        return Finding("torch", "missing", "not installed", f"pip install 'torch=={PINNED_TORCH}'", True)
    if version.split("+")[0] != PINNED_TORCH:
        return Finding("torch", "warn", f"{version} (tested with {PINNED_TORCH})", required=True)
    return Finding("torch", "ok", version, required=True)


def probe_python_deps() -> list[Finding]:
    """The light runtime dependencies of ascend-dist-common."""
    findings = []
    for dist in ("numpy", "msgspec", "pyzmq"):
        version = _version(dist)
        if version is None:
            findings.append(Finding(dist, "missing", "not installed", f"pip install {dist}", True))
        else:
            findings.append(Finding(dist, "ok", version, required=True))
    return findings


def probe_members() -> list[Finding]:
    """Every ascend-dist distribution and its version (only ascend-dist-common is required)."""
    findings = []
    for dist in MEMBERS:
        version = _version(dist)
        required = dist == "ascend-dist-common"
        if version is None:
            extra = dist.removeprefix("ascend-dist-")
            fix = f"pip install {dist}" if required else f"pip install 'ascend-dist[{extra}]' when you need it"
            findings.append(Finding(dist, "missing" if required else "warn", "not installed", fix, required))
        else:
            findings.append(Finding(dist, "ok", version, required=required))
    return findings


def probe_libibverbs() -> Finding:
    """The Mooncake wheels link libibverbs.so.1 even for TCP."""
    try:
        ctypes.CDLL("libibverbs.so.1")
    except OSError as exc:
        return Finding(
            "libibverbs.so.1",
            "missing",
            f"cannot be loaded ({exc})",
            "apt-get install -y --no-install-recommends libibverbs1  (Mooncake needs it even for TCP)",
            _mooncake_required(),
        )
    return Finding("libibverbs.so.1", "ok", "loadable", required=_mooncake_required())


def _mooncake_required() -> bool:
    return any(_version(dist) is not None for dist in MOONCAKE_USERS)


_ENGINE_PROBE = """
import json
from mooncake.engine import TransferEngine
te = TransferEngine()
rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
print(json.dumps({"rc": rc, "port": te.get_rpc_port() if rc == 0 else None}))
"""


def probe_mooncake(timeout_s: float = ENGINE_PROBE_TIMEOUT_S) -> Finding:
    """Mooncake installed, importable, and a TCP engine really starts on 127.0.0.1 (in a child process)."""
    required = _mooncake_required()
    variants = [f"{d} {v}" for d in MOONCAKE_VARIANTS if (v := _version(d)) is not None]
    if not variants:
        fix = "pip install 'ascend-dist[cpu]' (CPU/TCP), 'ascend-dist[cuda]' or 'ascend-dist[npu]'"
        return Finding("mooncake engine", "missing", "no Mooncake wheel installed", fix, required)
    if len(variants) > 1:
        detail = f"several variants installed ({', '.join(variants)}); they overwrite one module"
        return Finding("mooncake engine", "missing", detail, "keep exactly one Mooncake variant", required)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _ENGINE_PROBE], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return Finding(
            "mooncake engine", "missing", f"{variants[0]}: engine start hung > {timeout_s:.0f} s", "", required
        )
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    try:
        result = json.loads(last[0])
    except json.JSONDecodeError:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        fix = "install libibverbs1 (see above)" if "libibverbs" in error else "see the error"
        return Finding("mooncake engine", "missing", f"{variants[0]}: {error}", fix, required)
    if result.get("rc") != 0:
        return Finding(
            "mooncake engine", "missing", f"{variants[0]}: initialize returned {result.get('rc')}", "", required
        )
    detail = f"{variants[0]}: TCP engine started on 127.0.0.1:{result['port']}"
    return Finding("mooncake engine", "ok", detail, required=required)


def probe_vllm() -> Finding:
    """VLLM is optional here: its version only (importing it takes ~15 s)."""
    version = _version("vllm")
    if version is None:
        return Finding("vllm", "warn", "not installed (needed only to serve)", f"pip install 'vllm=={PINNED_VLLM}'")
    if importlib.util.find_spec("vllm") is None:
        return Finding("vllm", "missing", f"{version} metadata present but the module is not importable")
    status: Status = "ok" if version == PINNED_VLLM else "warn"
    return Finding("vllm", status, version if status == "ok" else f"{version} (tested with {PINNED_VLLM})")
