"""The error hierarchy shared by every ascend_dist package.

Every error raised by ascend_dist code derives from `AscendDistError`, and each subclass also
inherits the builtin a caller would naturally catch (`ValueError` for bad input, `TimeoutError`
for a missed deadline), so both ``except AscendDistError`` and ``except ValueError`` work.
Each class docstring says how a caller should degrade.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "AscendDistError",
    "BatchCopyError",
    "BlockIdError",
    "ConfigError",
    "DeadlineExceeded",
    "DeviceError",
    "DeviceUnavailable",
    "IncompatiblePeer",
    "InvalidTransition",
    "LayoutError",
    "LeaseExpired",
    "MessageTooLarge",
    "NativeLibraryError",
    "PeerNotAuthenticated",
    "PeerUnreachable",
    "ProtocolError",
    "RegionError",
    "StoreError",
    "TransferError",
    "TransferRefused",
    "TransferTimeout",
    "format_allowed",
]


def format_allowed(values: Iterable[object]) -> str:
    """Render allowed values for an error message: ``'a', 'b' or 'c'``."""
    shown = [repr(v) for v in values]
    if len(shown) <= 1:
        return "".join(shown)
    return ", ".join(shown[:-1]) + " or " + shown[-1]


class AscendDistError(Exception):
    """Root of every error raised by ascend_dist packages."""


class ConfigError(AscendDistError, ValueError):
    """A configuration value (kv_transfer_config, env var, argument) is invalid.

    Raised at construction time, before any resource is taken: fix the named field and retry.
    """

    def __init__(self, field: str, value: object, expected: str) -> None:
        """Name the offending field, the value seen and what was expected."""
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{field}={value!r} is invalid: expected {expected}")


class BlockIdError(ConfigError):
    """A block-id list is malformed (negative, out of range, wrong length)."""


class RegionError(ConfigError):
    """Memory regions to register overlap, are out of order, empty, or too many."""


class LayoutError(ConfigError):
    """A KV-cache tensor does not match any supported layout; nothing was registered."""


class ProtocolError(AscendDistError, ValueError):
    """A message from a peer could not be decoded or is not the expected type.

    Servers log and drop the message and keep serving; clients treat the exchange as failed.
    ``reply``: when set (by a codec's ``refuse`` hook), the encoded answer a server sends the
    peer instead of an error frame, such as a refusal naming the field it could not accept.
    """

    reply: bytes | None = None


class MessageTooLarge(ProtocolError):
    """A frame exceeds the decoder's size bound; it was dropped without being decoded."""


class IncompatiblePeer(ProtocolError):
    """A peer's handshake differs in protocol version or compatibility fields.

    The connection is refused. `field` names the first differing field; no transfer is attempted.
    """

    def __init__(self, field: str, local: object, remote: object) -> None:
        """Record the first field that differs between the two sides."""
        self.field = field
        self.local = local
        self.remote = remote
        super().__init__(f"incompatible peer: {field} differs (local={local!r}, remote={remote!r})")


class PeerNotAuthenticated(ProtocolError):
    """A frame's MAC did not verify under the deployment secret, or only one side has a secret.

    The frame was refused before any handler saw it. ``reason`` names the check that failed
    (``"missing"``, ``"mac"``, ``"stale"``, ``"replay"``, ``"unexpected"``); never retried: give both
    peers the same secret (see `ascend_dist.common.secret`).
    """

    def __init__(self, reason: str, detail: str) -> None:
        """Record which check failed."""
        self.reason = reason
        super().__init__(f"peer not authenticated ({reason}): {detail}")


class InvalidTransition(AscendDistError, RuntimeError):
    """A state machine was asked for a transition its table forbids: a bug in the caller."""

    def __init__(self, key: object, old: object, new: object) -> None:
        """Name the tracked item and both states."""
        self.key = key
        self.old = old
        self.new = new
        super().__init__(f"{key}: illegal transition {old} -> {new}")


class DeadlineExceeded(AscendDistError, TimeoutError):
    """A bounded wait ran out. The operation was abandoned; its resources were released."""


class TransferError(AscendDistError, RuntimeError):
    """A KV transfer failed. The affected blocks are reported as load errors and recomputed."""

    def __init__(self, message: str, *, request_id: str | None = None, peer: str | None = None) -> None:
        """Attach the request and peer the failure belongs to."""
        self.request_id = request_id
        self.peer = peer
        where = ", ".join(f"{k}={v}" for k, v in (("request", request_id), ("peer", peer)) if v)
        super().__init__(f"{message} ({where})" if where else message)


class TransferTimeout(TransferError, TimeoutError):
    """A transfer missed its deadline; handled like any other `TransferError`."""


class LeaseExpired(TransferError):
    """The peer no longer holds the blocks to transfer (its lease ran out or it freed them); recompute."""


class PeerUnreachable(TransferError, ConnectionError):
    """The peer's address did not answer at all; handled like any other `TransferError`."""


class TransferRefused(TransferError):
    """The peer answered but refused the transfer (mismatch, unknown request); handled like any other."""


class StoreError(AscendDistError, RuntimeError):
    """A KV-pool backend failed. On `get`/`exists`: treat as a cache miss and recompute."""


class NativeLibraryError(AscendDistError, RuntimeError):
    """A native library call returned an error code; carries the library's own message."""

    def __init__(self, func: str, code: int, message: str) -> None:
        """Record the failing function, its return code and the library's error string."""
        self.func = func
        self.code = code
        self.library_message = message
        super().__init__(f"{func} failed with code {code}: {message}")


class DeviceError(AscendDistError, RuntimeError):
    """The device runtime failed (stream, event, copy or IPC operation)."""


class DeviceUnavailable(DeviceError):
    """The requested device backend cannot be used on this machine; the message says why."""


class BatchCopyError(DeviceError):
    """A batched copy failed at one descriptor; earlier descriptors completed, later ones did not run."""

    def __init__(self, index: int, reason: str) -> None:
        """Record the index of the failing descriptor."""
        self.index = index
        super().__init__(f"batch copy failed at descriptor {index}: {reason}")
