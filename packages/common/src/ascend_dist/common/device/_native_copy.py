"""ctypes bindings for the asynchronous memcpy of the CUDA runtime and of Ascend ACL.

Runs in: worker processes on the ``cuda`` or ``npu`` backend.

Why ctypes: torch has no batched copy between raw addresses, and the batch-copy contract
(`base.DescriptorBatch`) is expressed in addresses. Each descriptor becomes one async memcpy enqueued on
the torch stream's native handle, in calls of at most 4096 descriptors issued back to back.
(``cudaMemcpyBatchAsync`` changed signature between CUDA 12.8 and 13; the per-descriptor loop has the
same semantics on every version.)

Which library: the copy torch itself loaded, found in ``/proc/self/maps``, so stream handles and
the device context are shared; else the CUDA wheel's ``nvidia/*/lib`` folder, else the system search
path (CANN's ``set_env.sh`` puts ``libascendcl.so`` there).

Unsafe: every call dereferences raw addresses. `validate_batch` rejected malformed batches;
addresses outside live allocations are reported by the runtime as an error code, which becomes a
`BatchCopyError` carrying the global descriptor index.

Host functions (CUDA): ``cudaLaunchHostFunc`` with one module-level C trampoline; the callback runs
on a CUDA-internal thread and must not call CUDA.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import itertools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Final

from ascend_dist.common.device.base import CopyDirection, DescriptorBatch, split_descriptors
from ascend_dist.common.errors import BatchCopyError, DeviceError, DeviceUnavailable

__all__ = ["AclRuntimeLib", "CudaRuntimeLib", "find_library", "issue_descriptors"]

logger = logging.getLogger(__name__)

_CUDA_MEMCPY_DEFAULT: Final = 4  # cudaMemcpyDefault: direction inferred from unified addressing
_ACL_KINDS: Final = {CopyDirection.H2D: 1, CopyDirection.D2H: 2, CopyDirection.D2D: 3}  # aclrtMemcpyKind

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _mapped(stem: str) -> str | None:
    """Path of a shared library already mapped into this process whose name starts with ``stem``."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and Path(parts[5]).name.startswith(stem):
            return parts[5]
    return None


def find_library(stem: str, short: str) -> str:
    """Locate a runtime library, preferring the copy already loaded by torch.

    Args:
        stem: File-name prefix, e.g. ``"libcudart.so"``.
        short: Name for `ctypes.util.find_library`, e.g. ``"cudart"``.

    Returns:
        A path or soname loadable by `ctypes.CDLL`.

    Raises:
        DeviceUnavailable: Not loaded, not in the ``nvidia`` wheels, not on the search path.
    """
    found = _mapped(stem)
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidates = sorted(Path(folder).glob(f"*/lib/{stem}*"))
        if candidates:
            return str(candidates[0])
    name = ctypes.util.find_library(short)
    if name:
        return name
    raise DeviceUnavailable(f"{stem} not found: not loaded by torch, not in the nvidia wheels, not on the library path")


def issue_descriptors(
    batch: DescriptorBatch, memcpy: Callable[[int, int, int], int], explain: Callable[[int], str]
) -> None:
    """Call ``memcpy(src, dst, size)`` per descriptor, in calls of at most 4096 descriptors.

    Raises:
        BatchCopyError: ``memcpy`` returned a non-zero code; carries the global index.
    """
    for part in split_descriptors(len(batch)):
        src, dst, sizes = batch.src[part].tolist(), batch.dst[part].tolist(), batch.sizes[part].tolist()
        for offset, (s, d, n) in enumerate(zip(src, dst, sizes, strict=True)):
            if n and (code := memcpy(s, d, n)) != 0:
                raise BatchCopyError(part.start + offset, explain(code))


class _HostCallbacks:
    """Python callables waiting for their stream to reach them, keyed by the C ``userData``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[int, Callable[[], object]] = {}
        self._ids = itertools.count(1)  # 0 would arrive as NULL

    def add(self, fn: Callable[[], object]) -> int:
        with self._lock:
            key = next(self._ids)
            self._pending[key] = fn
        return key

    def pop(self, key: int | None) -> Callable[[], object] | None:
        with self._lock:
            return self._pending.pop(key or 0, None)


_CALLBACKS: Final = _HostCallbacks()


def _trampoline(user_data: int | None) -> None:
    fn = _CALLBACKS.pop(user_data)
    if fn is None:
        return
    try:
        fn()
    except Exception:  # nowhere to propagate from a CUDA thread: log it
        logger.exception("host function launched on a CUDA stream failed")


_TRAMPOLINE: Final = _HOST_FN(_trampoline)


def _load(path: str) -> tuple[str, ctypes.CDLL]:
    try:
        return path, ctypes.CDLL(path)
    except OSError as exc:
        raise DeviceUnavailable(f"cannot load {path}: {exc}") from exc


class CudaRuntimeLib:
    """``cudaMemcpyAsync`` and ``cudaLaunchHostFunc`` from the CUDA runtime torch uses."""

    def __init__(self, path: str | None = None) -> None:
        """Load libcudart (``path``, else `find_library`).

        Raises:
            DeviceUnavailable: The library cannot be found or loaded.
        """
        self.path, lib = _load(path or find_library("libcudart.so", "cudart"))
        # cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
        #                             cudaStream_t stream)
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._memcpy.restype = ctypes.c_int
        # const char* cudaGetErrorString(cudaError_t error)
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes = [ctypes.c_int]
        self._error_string.restype = ctypes.c_char_p
        # cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* userData)
        self._launch = lib.cudaLaunchHostFunc
        self._launch.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int

    def _describe(self, code: int) -> str:
        text = self._error_string(code)
        return text.decode(errors="replace") if text else "unknown error"

    def copy(self, batch: DescriptorBatch, stream_handle: int) -> None:
        """Enqueue every descriptor on the stream (direction inferred by unified addressing).

        Raises:
            BatchCopyError: A memcpy was refused; descriptors before it were enqueued.
        """
        issue_descriptors(
            batch,
            lambda s, d, n: self._memcpy(d, s, n, _CUDA_MEMCPY_DEFAULT, stream_handle),
            lambda code: f"cudaMemcpyAsync returned {code} ({self._describe(code)})",
        )

    def launch_host_func(self, stream_handle: int, fn: Callable[[], object]) -> None:
        """Enqueue ``fn`` on the stream through ``cudaLaunchHostFunc``.

        Raises:
            DeviceError: The launch was refused.
        """
        key = _CALLBACKS.add(fn)
        code = self._launch(stream_handle, _TRAMPOLINE, key)
        if code != 0:
            _CALLBACKS.pop(key)
            raise DeviceError(f"cudaLaunchHostFunc returned {code} ({self._describe(code)})")


class AclRuntimeLib:
    """``aclrtMemcpyAsync`` from Ascend's libascendcl."""

    def __init__(self, path: str | None = None) -> None:
        """Load libascendcl (``path``, else `find_library`).

        Raises:
            DeviceUnavailable: The library cannot be found or loaded.
        """
        self.path, lib = _load(path or find_library("libascendcl.so", "ascendcl"))
        # aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count,
        #                           aclrtMemcpyKind kind, aclrtStream stream)
        self._memcpy = lib.aclrtMemcpyAsync
        self._memcpy.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._memcpy.restype = ctypes.c_int
        # const char* aclGetRecentErrMsg(void)  (absent from old CANN)
        self._recent_error = getattr(lib, "aclGetRecentErrMsg", None)
        if self._recent_error is not None:
            self._recent_error.argtypes = []
            self._recent_error.restype = ctypes.c_char_p

    def _describe(self) -> str:
        text = self._recent_error() if self._recent_error is not None else None
        return text.decode(errors="replace") if text else "no message"

    def copy(self, batch: DescriptorBatch, stream_handle: int) -> None:
        """Enqueue every descriptor on the stream with ``dst_max = size``.

        Raises:
            BatchCopyError: A memcpy was refused; descriptors before it were enqueued.
        """
        kind = _ACL_KINDS[batch.direction]
        issue_descriptors(
            batch,
            lambda s, d, n: self._memcpy(d, n, s, n, kind, stream_handle),
            lambda code: f"aclrtMemcpyAsync returned {code} ({self._describe()})",
        )
