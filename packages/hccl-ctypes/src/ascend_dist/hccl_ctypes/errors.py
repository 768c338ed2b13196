"""Errors of the collective binding and the communicator, under `ascend_dist.common.errors`.

Runs in: any process; no torch, no native library.
"""

from __future__ import annotations

from ascend_dist.common.errors import AscendDistError, ConfigError, NativeLibraryError

__all__ = [
    "CollectiveError",
    "CommunicatorClosed",
    "CommunicatorUnavailable",
    "HcclError",
    "LibraryLoadError",
    "NcclError",
    "SymbolNotExported",
    "UnsupportedDtype",
    "UnsupportedOp",
]


class CollectiveError(NativeLibraryError):
    """A collective library call returned a non-zero code; carries the library's own error string.

    The communicator that raised it should be treated as broken: destroy it and build a new one
    (all ranks). `func` names the C symbol, `code` is the raw return value.
    """


class HcclError(CollectiveError):
    """An HCCL call failed (``HcclResult`` != 0)."""

    @classmethod
    def upstream(cls, code: int, message: str) -> HcclError:
        """The error of ``HCCLLibrary.HCCL_CHECK``: upstream's text ``HCCL error: <message>``.

        Code written against vllm-ascend's binding may match that text; ``func`` is ``"HCCL_CHECK"``.
        """
        err = cls("HCCL_CHECK", code, message)
        err.args = (f"HCCL error: {message}",)  # str() is upstream's; func/code/library_message stay
        return err


class NcclError(CollectiveError):
    """An NCCL call failed (``ncclResult_t`` != 0)."""


class LibraryLoadError(AscendDistError, OSError):
    """The shared library could not be loaded.

    Degrade: the communicator falls back to disabled mode (or gloo on the CPU); set the env var named
    in the message to the library's path to fix it.
    """

    def __init__(self, path: str, env_var: str, reason: str) -> None:
        """Name the path tried, the override env var and the loader's reason."""
        self.path = path
        self.env_var = env_var
        self.reason = reason
        super().__init__(f"cannot load collective library {path!r} ({reason}); set {env_var} to its path")


class SymbolNotExported(AscendDistError, AttributeError):
    """The loaded library does not export an optional symbol (e.g. ``HcclSend`` on an old CANN).

    Degrade: do not use that operation with this library.
    """

    def __init__(self, symbol: str, path: str) -> None:
        """Name the symbol and the library."""
        self.symbol = symbol
        self.path = path
        super().__init__(f"{path!r} does not export {symbol}")


class UnsupportedDtype(ConfigError):
    """A tensor dtype has no code in the library's data-type enum; nothing was called."""


class UnsupportedOp(ConfigError):
    """A reduce operation has no code in the library's reduce-op enum; nothing was called."""


class CommunicatorUnavailable(AscendDistError, RuntimeError):
    """The communicator is disabled (no usable library); its collectives refuse to run.

    Degrade: check `PyHcclCommunicator.disabled` / `disabled_reason` and use another path.
    """


class CommunicatorClosed(AscendDistError, RuntimeError):
    """An operation was called after `PyHcclCommunicator.destroy`: a bug in the caller."""
