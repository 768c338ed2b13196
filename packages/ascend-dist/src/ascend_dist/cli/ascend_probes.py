"""`ascend-dist doctor`'s Ascend checks: CANN, libhccl, torch_npu, visible NPUs, vLLM registrations.

Runs in: the `ascend-dist` command's process; torch_npu and vLLM are imported only in child
processes with a deadline (a broken CANN install can crash or hang the importer).

The facts come from an `AscendHost` (`SystemAscendHost` reads this machine); `ascend_findings` turns
them into findings, each failure with its fix. A host with no sign of Ascend (no ``/dev/davinci*``,
no CANN toolkit, no ``ASCEND_*`` toolkit variable) gets one line, "not an Ascend host", that blocks
nothing.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ascend_dist.cli.probes import Finding

__all__ = ["AscendHost", "NpuRuntime", "SystemAscendHost", "ascend_findings", "probe_ascend"]

CHILD_TIMEOUT_S = 120.0
SET_ENV = "source /usr/local/Ascend/ascend-toolkit/set_env.sh (or your toolkit's set_env.sh)"
_TOOLKIT_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
_ROOTS = (Path("/usr/local/Ascend/ascend-toolkit/latest"), Path("/usr/local/Ascend/cann"))
_VERSION_FILES = ("compiler/version.info", "runtime/version.info", "version.info", "../ascend_toolkit_install.info")


@dataclass(frozen=True)
class NpuRuntime:
    """What a child process saw: torch's and torch_npu's versions, visible NPUs, the import error if any."""

    torch: str | None
    torch_npu: str | None
    device_count: int
    error: str


class AscendHost(Protocol):
    """The facts the Ascend checks read (injected: tests pass fakes)."""

    def ascend_markers(self) -> list[str]:
        """Evidence this is an Ascend host (device nodes, toolkit paths); empty: it is not."""
        ...

    def cann_version(self) -> str | None:
        """The CANN toolkit's version, or None when no toolkit is found."""
        ...

    def load_hccl(self) -> str:
        """Load libhccl; return what was loaded. Raises OSError when it cannot be loaded."""
        ...

    def npu_runtime(self) -> NpuRuntime:
        """Import torch and torch_npu (in a child process) and count the visible NPUs."""
        ...

    def vllm_components(self) -> tuple[list[str], list[str]] | str:
        """(installed components, what the plugin registered with vLLM), or why that cannot be asked."""
        ...


_RUNTIME_CHILD = """
import json
out = {"torch": None, "torch_npu": None, "device_count": 0, "error": ""}
try:
    import torch
    out["torch"] = torch.__version__
    import torch_npu
    out["torch_npu"] = getattr(torch_npu, "__version__", None)
    out["device_count"] = int(torch.npu.device_count())
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

_COMPONENTS_CHILD = """
import json
from ascend_dist import plugin
from ascend_dist.plugin import startup_hooks
if not plugin._installed("vllm"):
    print(json.dumps("vLLM is not installed: nothing to register with"))
else:
    expected = [f"{c.factory}:{c.name}" for c in plugin.COMPONENTS if plugin._installed(c.module)]
    expected += [f"startup:{h.name}" for h in startup_hooks.HOOKS if plugin._installed(h.module)]
    plugin.register()
    print(json.dumps([expected, sorted(plugin.registered_names())]))
"""


def _child_json(code: str, timeout_s: float) -> object:
    """Run ``code`` in a fresh interpreter; its last stdout line as JSON (RuntimeError with its stderr if none)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"hung for more than {timeout_s:.0f} s") from exc
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        error = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}, no output"])[-1]
        raise RuntimeError(error) from None


class SystemAscendHost:
    """This machine's facts."""

    def __init__(
        self,
        *,
        environ: Mapping[str, str] = os.environ,
        roots: Sequence[Path] = _ROOTS,
        dev: Path = Path("/dev"),
        timeout_s: float = CHILD_TIMEOUT_S,
    ) -> None:
        """Read ``environ`` for toolkit variables, ``roots`` for toolkits, ``dev`` for device nodes."""
        self._environ, self._roots, self._dev, self._timeout_s = environ, roots, dev, timeout_s

    def _toolkits(self) -> list[tuple[str, Path]]:
        found = [(name, Path(self._environ[name])) for name in _TOOLKIT_VARS if self._environ.get(name)]
        found += [(str(root), root) for root in self._roots if root.is_dir()]
        return found

    def ascend_markers(self) -> list[str]:
        """Device nodes ``/dev/davinci*`` and toolkit locations that exist."""
        markers = sorted(str(p) for p in self._dev.glob("davinci[0-9]*")) if self._dev.is_dir() else []
        markers += [f"{name}={path}" for name, path in self._toolkits() if path.is_dir()]
        return markers

    def cann_version(self) -> str | None:
        """The first ``Version=`` / ``version=`` line of the toolkit's version files."""
        for _, toolkit in self._toolkits():
            for name in _VERSION_FILES:
                path = toolkit / name
                if not path.is_file():
                    continue
                for line in path.read_text(errors="replace").splitlines():
                    key, _, value = line.partition("=")
                    if key.strip().lower() == "version" and value.strip():
                        return value.strip()
        return None

    def load_hccl(self) -> str:
        """``HCCL_SO_PATH`` or ``libhccl.so`` through the loader's search path."""
        name = self._environ.get("HCCL_SO_PATH") or "libhccl.so"
        ctypes.CDLL(name)
        return name

    def npu_runtime(self) -> NpuRuntime:
        """Torch and torch_npu imported in a child process."""
        try:
            out = _child_json(_RUNTIME_CHILD, self._timeout_s)
        except RuntimeError as exc:
            return NpuRuntime(None, None, 0, f"the import crashed or hung: {exc}")
        assert isinstance(out, dict)
        return NpuRuntime(out["torch"], out["torch_npu"], int(out["device_count"]), str(out["error"]))

    def vllm_components(self) -> tuple[list[str], list[str]] | str:
        """The plugin's registration run in a child process, against the real vLLM registries."""
        try:
            out = _child_json(_COMPONENTS_CHILD, self._timeout_s)
        except RuntimeError as exc:
            return f"registering crashed or hung: {exc}"
        if isinstance(out, str):
            return out
        assert isinstance(out, list)
        return list(out[0]), list(out[1])


def _base(version: str) -> str:
    """``2.5.1`` of ``2.5.1+cpu`` / ``2.5.1.post1`` / ``2.5.1rc1``: torch_npu releases follow torch's."""
    head = version.split("+", maxsplit=1)[0]
    parts = head.split(".")[:3]
    return ".".join("".join(ch for ch in p if ch.isdigit()) or "0" for p in parts)


def ascend_findings(host: AscendHost) -> list[Finding]:
    """The Ascend checks, in report order; only an Ascend host is checked beyond the first line."""
    markers = host.ascend_markers()
    if not markers:
        detail = "not an Ascend host (no /dev/davinci*, no CANN toolkit, no ASCEND_* toolkit variable): skipped"
        return [Finding("ascend host", "ok", detail)]
    findings = [Finding("ascend host", "ok", ", ".join(markers[:4]), required=True)]
    cann = host.cann_version()
    if cann is None:
        findings.append(Finding("CANN", "missing", "no toolkit version found", SET_ENV, True))
    else:
        findings.append(Finding("CANN", "ok", cann, required=True))
    try:
        findings.append(Finding("libhccl", "ok", f"{host.load_hccl()} loads", required=True))
    except OSError as exc:
        fix = f"{SET_ENV}, or set HCCL_SO_PATH to the toolkit's lib64/libhccl.so"
        findings.append(Finding("libhccl", "missing", f"cannot be loaded ({exc})", fix, True))
    findings += _runtime_findings(host.npu_runtime(), cann)
    findings.append(_registrations(host.vllm_components()))
    return findings


def _runtime_findings(rt: NpuRuntime, cann: str | None) -> list[Finding]:
    if rt.torch_npu is None:
        detail = f"cannot be imported ({rt.error or 'not installed'}); CANN seen: {cann or 'none'}"
        fix = f"pip install the torch-npu release of torch {rt.torch or '?'} built for CANN {cann or '?'}; {SET_ENV}"
        return [
            Finding("torch_npu", "missing", detail, fix, True),
            Finding("NPU devices", "missing", "unknown: torch_npu does not import", "fix torch_npu first", True),
        ]
    found = []
    if rt.torch is not None and _base(rt.torch) != _base(rt.torch_npu):
        detail = f"torch_npu {rt.torch_npu} is not the release of torch {rt.torch}"
        fix = f"pip install 'torch-npu=={_base(rt.torch)}.*' (or the torch its release pairs with)"
        found.append(Finding("torch_npu", "missing", detail, fix, True))
    else:
        found.append(Finding("torch_npu", "ok", f"{rt.torch_npu} with torch {rt.torch}, CANN {cann}", required=True))
    if rt.device_count <= 0:
        fix = "check `npu-smi info`; unset or correct ASCEND_RT_VISIBLE_DEVICES; in a container: --device /dev/davinciN"
        found.append(
            Finding("NPU devices", "missing", f"none visible{f' ({rt.error})' if rt.error else ''}", fix, True)
        )
    else:
        found.append(Finding("NPU devices", "ok", f"{rt.device_count} visible", required=True))
    return found


def _registrations(result: tuple[list[str], list[str]] | str) -> Finding:
    if isinstance(result, str):
        return Finding("vLLM registrations", "warn", result, "pip install 'ascend-dist[vllm]' to serve")
    expected, registered = result
    missing = [name for name in expected if name not in registered]
    if missing:
        fix = f"not registered: {', '.join(missing)}; read the plugin's warning in the log (taken by another plugin?)"
        return Finding("vLLM registrations", "missing", f"{len(missing)} of {len(expected)} missing", fix, True)
    return Finding("vLLM registrations", "ok", f"all {len(expected)} installed components registered", required=True)


def probe_ascend() -> list[Finding]:
    """Doctor's probe over this machine."""
    return ascend_findings(SystemAscendHost())
