"""The deployment secret: one key shared by every node of a deployment, for MACs and capabilities.

An operator turns authentication on by giving every P, D, SFA peer, metaserver client and pool
node the same secret, either as a key file (``ASCEND_DIST_SECRET_FILE``: readable by its owner
only, owned by the user running the engine) or as hex in ``ASCEND_DIST_SECRET`` (convenient for
containers; visible in ``/proc/<pid>/environ`` to the same user). ``ascend-dist secret --write
PATH`` creates a key file. Without either, connectors run as upstream's do (no authentication)
and say so once at start (`warn_unauthenticated`).

Each use derives its own subkey (`DeploymentSecret.key_for`), so a MAC made for one purpose (a
frame) can never be presented as another (a transfer capability).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from collections.abc import Mapping
from pathlib import Path

from ascend_dist.common.errors import ConfigError

__all__ = [
    "MIN_SECRET_BYTES",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "DeploymentSecret",
    "load_secret",
    "warn_unauthenticated",
    "write_secret_file",
]

SECRET_ENV = "ASCEND_DIST_SECRET"
SECRET_FILE_ENV = "ASCEND_DIST_SECRET_FILE"
MIN_SECRET_BYTES = 32
TAG_BYTES = 32  # HMAC-SHA256, untruncated

_log = logging.getLogger(__name__)
_warned = threading.Event()


class DeploymentSecret:
    """The shared key; signs and verifies byte strings under a named purpose."""

    __slots__ = ("_key", "_subkeys")

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ConfigError("secret", f"{len(key)} bytes", f"at least {MIN_SECRET_BYTES} random bytes")
        self._key = bytes(key)
        self._subkeys: dict[str, bytes] = {}

    def __repr__(self) -> str:  # never print the key
        return "DeploymentSecret(<hidden>)"

    def key_for(self, purpose: str) -> bytes:
        """The subkey for one use (``"frame"``, ``"pull-capability"``, ...)."""
        subkey = self._subkeys.get(purpose)
        if subkey is None:
            subkey = hmac.digest(self._key, b"ascend-dist/" + purpose.encode(), hashlib.sha256)
            self._subkeys[purpose] = subkey
        return subkey

    def sign(self, purpose: str, data: bytes) -> bytes:
        """A ``TAG_BYTES`` MAC over ``data`` under ``purpose``'s subkey."""
        return hmac.digest(self.key_for(purpose), data, hashlib.sha256)

    def verify(self, purpose: str, data: bytes, tag: bytes) -> bool:
        """Whether ``tag`` is ``sign(purpose, data)``, compared in constant time."""
        return hmac.compare_digest(self.sign(purpose, data), tag)


def load_secret(environ: Mapping[str, str] | None = None) -> DeploymentSecret | None:
    """The secret the environment names, or None when neither variable is set.

    Raises `ConfigError` naming the variable when the value or the file is unusable: a file others
    can read or that another user owns is refused (a key in a world-writable /tmp is not a secret).
    """
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_ENV, "")
    inline = env.get(SECRET_ENV, "")
    if path and inline:
        raise ConfigError(SECRET_ENV, "<set>", f"unset when {SECRET_FILE_ENV} is set (one source of the key)")
    if path:
        return DeploymentSecret(_read_key_file(Path(path)))
    if inline:
        try:
            key = bytes.fromhex(inline.strip())
        except ValueError:
            raise ConfigError(SECRET_ENV, "<not hex>", "the key as hex digits") from None
        return DeploymentSecret(key)
    return None


def _read_key_file(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigError(SECRET_FILE_ENV, str(path), f"a readable key file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(SECRET_FILE_ENV, str(path), "a regular file")
        if info.st_uid != os.geteuid():
            raise ConfigError(SECRET_FILE_ENV, str(path), "a file owned by the user running this process")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(SECRET_FILE_ENV, str(path), "mode 0600 or 0400 (it is readable by others)")
        text = os.read(fd, 4096).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ConfigError(SECRET_FILE_ENV, str(path), "the key as hex digits") from None


def write_secret_file(path: Path, nbytes: int = MIN_SECRET_BYTES) -> None:
    """Create ``path`` (it must not exist) holding a fresh random key as hex, mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, (secrets.token_bytes(max(nbytes, MIN_SECRET_BYTES)).hex() + "\n").encode())
    finally:
        os.close(fd)


def warn_unauthenticated(component: str) -> None:
    """Log once per process that peers are not authenticated and how to turn it on."""
    if _warned.is_set():
        return
    _warned.set()
    _log.warning(
        "%s: peers are not authenticated (no deployment secret). Set %s to a key file made by "
        "`ascend-dist secret --write PATH` (or %s to its hex) on every node to authenticate frames "
        "and sign transfer capabilities.",
        component,
        SECRET_FILE_ENV,
        SECRET_ENV,
    )
