"""Choosing the device backend of a process: ``npu``, ``cuda`` or the ``cpu`` simulation.

Runs in: every process, once, when the process-wide runtime is first requested.

Order: ``ASCEND_DIST_DEVICE`` when set, else auto-detection (torch_npu importable and an NPU
present, then CUDA, then CPU). torch_npu is probed defensively: without CANN,
``import torch_npu`` raises ImportError, OSError or RuntimeError, and torch_npu's autoload entry
point can even break a plain ``import torch``; so `prepare_torch_import` sets
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (unless the user set it) before the first ``import torch`` of the
process, and every module here that needs torch imports it only after calling it.

The hardware probes sit behind the small `BackendProbe` Protocol so that tests can drive every
branch of the selection with a fake probe, without hardware and without patching.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from ascend_dist.common.errors import ConfigError, DeviceUnavailable, format_allowed

__all__ = [
    "BACKENDS",
    "DEVICE_ENV",
    "BackendChoice",
    "BackendProbe",
    "SystemProbe",
    "prepare_torch_import",
    "select_backend",
]

logger = logging.getLogger(__name__)

BACKENDS: Final = ("npu", "cuda", "cpu")
"""Backend names, in auto-detection order."""

DEVICE_ENV: Final = "ASCEND_DIST_DEVICE"
"""Environment variable that forces a backend."""

_AUTOLOAD_ENV: Final = "TORCH_DEVICE_BACKEND_AUTOLOAD"


def prepare_torch_import() -> None:
    """Disable torch's device-extension autoload unless the user chose otherwise.

    Must run before the process's first ``import torch``: with torch_npu installed but CANN
    missing, the autoload hook makes ``import torch`` itself fail. The probe then
    imports torch_npu explicitly, under ``try``.
    """
    os.environ.setdefault(_AUTOLOAD_ENV, "0")


@dataclass(frozen=True)
class BackendChoice:
    """The backend a process will use and, in one sentence, why."""

    name: str
    reason: str


class BackendProbe(Protocol):
    """Reports whether each hardware backend is usable; each answer comes with a reason."""

    def npu(self) -> tuple[bool, str]:
        """Return (usable, reason) for the Ascend NPU backend."""
        ...

    def cuda(self) -> tuple[bool, str]:
        """Return (usable, reason) for the CUDA backend."""
        ...


class SystemProbe:
    """The real probes: import torch_npu / torch defensively and ask for devices."""

    def npu(self) -> tuple[bool, str]:
        """Probe torch_npu and the NPU devices.

        Returns:
            ``(True, reason)`` when torch_npu imports and at least one NPU is present, else
            ``(False, reason)`` naming what is missing.
        """
        prepare_torch_import()
        if importlib.util.find_spec("torch_npu") is None:
            return False, "torch_npu not installed"
        try:
            importlib.import_module("torch_npu")
            import torch
        except (ImportError, OSError, RuntimeError) as exc:
            return False, f"torch_npu present but unusable: {type(exc).__name__}: {exc}"
        npu = getattr(torch, "npu", None)
        if npu is None:
            return False, "torch_npu imported but torch.npu is missing"
        try:
            count = int(npu.device_count()) if npu.is_available() else 0
        except RuntimeError as exc:
            return False, f"torch.npu unusable: {exc}"
        if count == 0:
            return False, "torch_npu importable but no NPU device present"
        return True, f"torch_npu importable and {count} NPU device(s) present"

    def cuda(self) -> tuple[bool, str]:
        """Probe CUDA through torch.

        Returns:
            ``(True, reason)`` when torch sees at least one CUDA device, else ``(False, reason)``.
        """
        prepare_torch_import()
        try:
            import torch
        except (ImportError, OSError, RuntimeError) as exc:
            return False, f"torch unusable: {type(exc).__name__}: {exc}"
        if not torch.cuda.is_available():
            return False, "CUDA not available"
        return True, f"CUDA available with {torch.cuda.device_count()} device(s)"


def _requested(env: Mapping[str, str]) -> str | None:
    """Return the backend named by ``ASCEND_DIST_DEVICE`` (None when unset or empty)."""
    raw = env.get(DEVICE_ENV)
    if raw is None or not raw.strip():
        return None
    name = raw.strip().lower()
    if name not in BACKENDS:
        raise ConfigError(DEVICE_ENV, raw, format_allowed(BACKENDS))
    return name


def select_backend(env: Mapping[str, str] | None = None, probe: BackendProbe | None = None) -> BackendChoice:
    """Decide which backend this process uses.

    Args:
        env: Environment to read ``ASCEND_DIST_DEVICE`` from (default: ``os.environ``).
        probe: Hardware probe (default: `SystemProbe`).

    Returns:
        The chosen backend and the reason, e.g. ``BackendChoice("cpu", "torch_npu not installed;
        CUDA not available")``.

    Raises:
        ConfigError: ``ASCEND_DIST_DEVICE`` names an unknown backend.
        DeviceUnavailable: ``ASCEND_DIST_DEVICE`` names a hardware backend that cannot be used;
            the message says why.
    """
    env = os.environ if env is None else env
    probe = SystemProbe() if probe is None else probe
    requested = _requested(env)
    if requested == "cpu":
        return BackendChoice("cpu", f"{DEVICE_ENV}=cpu")
    if requested is not None:
        usable, why = probe.npu() if requested == "npu" else probe.cuda()
        if not usable:
            raise DeviceUnavailable(f"{DEVICE_ENV}={requested} but the backend is unusable: {why}")
        return BackendChoice(requested, f"{DEVICE_ENV}={requested}")
    npu_ok, npu_why = probe.npu()
    logger.debug("npu probe: usable=%s (%s)", npu_ok, npu_why)
    if npu_ok:
        return BackendChoice("npu", npu_why)
    cuda_ok, cuda_why = probe.cuda()
    logger.debug("cuda probe: usable=%s (%s)", cuda_ok, cuda_why)
    if cuda_ok:
        return BackendChoice("cuda", f"{npu_why}; {cuda_why}")
    return BackendChoice("cpu", f"{npu_why}; {cuda_why}")
