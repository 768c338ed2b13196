"""Named shared-memory segments backing the CPU simulation's IPC handles.

Runs in: processes using the ``cpu`` device backend that share tensors.

The creating side uses `multiprocessing.shared_memory.SharedMemory`, so the stdlib resource tracker
unlinks the segment if the creator dies without cleaning up. The opening side maps the segment
through ``/dev/shm`` directly where that exists (Linux): before Python 3.13, attaching a
`SharedMemory` by name registers it with the *opener's* resource tracker, which then unlinks the
creator's segment, with a "leaked shared_memory" warning, when an unrelated opener exits. Elsewhere
it falls back to `SharedMemory` (untracked on Python 3.13+).

Mappings are released by `ShmSegment.close`; tensors viewing them must not be used afterwards.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import sys
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path
from typing import Final

from ascend_dist.common.errors import ConfigError, DeviceError

__all__ = ["ShmSegment"]

logger = logging.getLogger(__name__)

_DEV_SHM: Final = Path("/dev/shm")
# Names come from another process: allow only what SharedMemory generates, never a path.
_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def _view_of(shm: shared_memory.SharedMemory) -> memoryview:
    """The mapping of an open `SharedMemory` (typed Optional, set once it is open)."""
    if shm.buf is None:
        raise DeviceError(f"shared-memory segment {shm.name!r} is not mapped")
    return shm.buf


class ShmSegment:
    """A named shared-memory segment mapped into this process."""

    def __init__(self, name: str, nbytes: int, buf: memoryview, owner: bool, closer: Callable[[], None]) -> None:
        """Wrap a mapping; use `create` or `open` instead."""
        self.name = name
        self.nbytes = nbytes
        self.buf = buf
        self.owner = owner
        self._closer = closer
        self._closed = False

    @classmethod
    def create(cls, nbytes: int) -> ShmSegment:
        """Create and map a fresh zero-filled segment of ``nbytes`` bytes.

        Args:
            nbytes: Size in bytes (0 maps one byte, as zero-length mappings do not exist).

        Returns:
            The segment, owned by this process (unlinked by `close`).
        """
        shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))

        def closer() -> None:
            shm.close()
            shm.unlink()

        logger.debug("created shared-memory segment %s (%d bytes)", shm.name, nbytes)
        return cls(shm.name, nbytes, _view_of(shm), True, closer)

    @classmethod
    def open(cls, name: str, nbytes: int) -> ShmSegment:
        """Map an existing segment created by another process.

        Args:
            name: Segment name as created (no path separators).
            nbytes: Bytes to map; the segment must be at least this large.

        Returns:
            The segment (not owned: `close` unmaps but does not unlink).

        Raises:
            ConfigError: ``name`` is not a valid segment name.
            DeviceError: No such segment, or it is smaller than ``nbytes``.
        """
        if not _NAME_RE.fullmatch(name):
            raise ConfigError("IpcHandle.payload", name, "a shared-memory segment name ([A-Za-z0-9_.-]+)")
        length = max(nbytes, 1)
        if _DEV_SHM.is_dir():
            return cls._open_dev_shm(name, nbytes, length)
        kwargs = {"track": False} if sys.version_info >= (3, 13) else {}
        try:
            shm = shared_memory.SharedMemory(name=name, **kwargs)
        except FileNotFoundError:
            raise DeviceError(f"no shared-memory segment named {name!r} (closed by its creator?)") from None
        if shm.size < length:
            shm.close()
            raise DeviceError(f"shared-memory segment {name!r} has {shm.size} bytes, handle needs {length}")
        return cls(name, nbytes, _view_of(shm), False, shm.close)

    @classmethod
    def _open_dev_shm(cls, name: str, nbytes: int, length: int) -> ShmSegment:
        """Map ``/dev/shm/<name>`` without involving the resource tracker."""
        try:
            fd = os.open(_DEV_SHM / name, os.O_RDWR)
        except FileNotFoundError:
            raise DeviceError(f"no shared-memory segment named {name!r} (closed by its creator?)") from None
        try:
            size = os.fstat(fd).st_size
            if size < length:
                raise DeviceError(f"shared-memory segment {name!r} has {size} bytes, handle needs {length}")
            mapping = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        view = memoryview(mapping)

        def closer() -> None:
            view.release()
            mapping.close()

        return cls(name, nbytes, view, False, closer)

    def close(self) -> None:
        """Unmap the segment (and unlink it when this process created it); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._closer()
        except (OSError, BufferError) as exc:
            logger.warning("closing shared-memory segment %s failed: %s", self.name, exc)
