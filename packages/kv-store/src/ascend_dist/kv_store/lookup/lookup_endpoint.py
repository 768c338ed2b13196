"""Where the lookup server publishes its endpoint: one file per instance in this user's private directory.

Runs in: the rank-0 worker (publishes) and the scheduler (reads), with ``lookup_rpc_port`` 0.

The file is ``{VLLM_RPC_BASE_PATH or tmp}/ascend-dist-lookup-{uid}/{instance}_dp{dp}.endpoint``,
``instance`` being vLLM's ``engine_id``. Upstream used one name per host, so a second instance
captured the first one's lookups and anyone on the host could plant the file. The directory is
created 0700 and, like the file (0600), must be this user's, closed to others and not a link, or
it is refused with `EndpointError`. A live process already publishing the same instance id is
never displaced (two instances configured with one ``engine_id``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ascend_dist.common.errors import ConfigError

__all__ = ["EndpointError", "check_endpoint_dir", "endpoint_dir", "endpoint_file", "publish_endpoint", "read_endpoint"]


class EndpointError(ConfigError):
    """An endpoint directory or file is not this user's private one (planted, foreign or open to others)."""


_MAX_ENDPOINT_FILE = 512
_ENDPOINT = re.compile(r"tcp://(?P<host>[0-9.]+|\[[0-9a-fA-F:]+\]):(?P<port>[0-9]{1,5})")


def _private(st: os.stat_result, what: str, path: Path, kind: int) -> None:
    """Refuse ``path`` unless it is of ``kind``, owned by this user and closed to group and others."""
    if stat.S_IFMT(st.st_mode) != kind:
        raise EndpointError(what, str(path), "this user's own entry, not a link or another kind of file")
    if st.st_uid != os.geteuid():
        raise EndpointError(what, str(path), f"owned by uid {os.geteuid()}, not uid {st.st_uid}")
    if st.st_mode & 0o077:
        raise EndpointError(what, str(path), f"closed to group and others, not mode {stat.S_IMODE(st.st_mode):o}")


def check_endpoint_dir(path: Path) -> None:
    """Refuse the endpoint directory ``path`` unless it is this user's private directory.

    Raises:
        FileNotFoundError: It does not exist.
        EndpointError: It is a link, not a directory, another user's, or open to others.
    """
    _private(os.lstat(path), "lookup endpoint directory", path, stat.S_IFDIR)


def endpoint_dir(env: Mapping[str, str] | None = None, *, create: bool = False) -> Path:
    """This user's private endpoint directory under ``VLLM_RPC_BASE_PATH`` (or the temp dir).

    Raises:
        EndpointError: It exists but is a link, not a directory, another user's, or open to others.
        ConfigError: ``create`` and it cannot be created.
    """
    env = os.environ if env is None else env
    path = Path(env.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()) / f"ascend-dist-lookup-{os.geteuid()}"
    if create:
        try:
            path.mkdir(mode=0o700, parents=False)
        except FileExistsError:
            pass  # checked below, never chmod-ed: a directory we did not create may be someone's trap
        except OSError as exc:
            raise ConfigError("VLLM_RPC_BASE_PATH", str(path.parent), f"a writable directory ({exc})") from exc
    with contextlib.suppress(FileNotFoundError):  # the client may start first: checked on every read too
        check_endpoint_dir(path)
    return path


def endpoint_file(instance: str, dp_rank: int, env: Mapping[str, str] | None = None, *, create: bool = False) -> Path:
    """Where the rank-0 worker of instance ``instance`` (vLLM's ``engine_id``), engine ``dp_rank`` publishes.

    Raises:
        ConfigError: ``instance`` is empty.
        EndpointError: The directory is not private (see `endpoint_dir`).
    """
    if not instance:
        raise ConfigError("engine_id", instance, "a non-empty instance id (vLLM's kv_transfer_config.engine_id)")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", instance)[:128]
    return endpoint_dir(env, create=create) / f"{safe}_dp{dp_rank}.endpoint"


def read_endpoint(path: Path) -> tuple[str, int] | None:
    """The ``(endpoint, pid)`` published in ``path``; None when nothing is published there.

    Raises:
        EndpointError: The file is a link, not a regular file, another user's, open to others,
            or does not name a loopback ``tcp://`` endpoint.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a planted symlink
        raise EndpointError(
            "lookup endpoint file", str(path), f"this user's own regular file ({exc.strerror})"
        ) from exc
    try:
        _private(os.fstat(fd), "lookup endpoint file", path, stat.S_IFREG)
        raw = os.read(fd, _MAX_ENDPOINT_FILE + 1)
    finally:
        os.close(fd)
    lines = raw.decode("ascii", "replace").split()
    match = _ENDPOINT.fullmatch(lines[0]) if len(lines) == 2 and lines[1].isdigit() else None
    if match is None or len(raw) > _MAX_ENDPOINT_FILE or not _loopback(match["host"].strip("[]")):
        raise EndpointError("lookup endpoint file", str(path), "'tcp://<loopback>:<port> <pid>'")
    return lines[0], int(lines[1])


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish_endpoint(path: Path, endpoint: str) -> None:
    """Write ``endpoint`` and our pid to ``path`` (0600, atomically, never through a link).

    Raises:
        EndpointError: ``path`` is not private, or another live process publishes there.
    """
    current = read_endpoint(path)
    if current is not None and current[1] != os.getpid() and _alive(current[1]):
        raise EndpointError(
            "engine_id", path.name, f"unique per instance on this host: pid {current[1]} already serves {current[0]}"
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, f"{endpoint} {os.getpid()}\n".encode("ascii"))
    finally:
        os.close(fd)
    tmp.replace(path)
