"""The ctypes binding: one `CollectiveLibrary` class, driven by a `Dialect` (HCCL or NCCL).

Runs in: any process that builds a communicator; imports no torch. Loading happens in the
constructor, never at import.

Path resolution: the explicit ``so_file`` argument, else the dialect's env var (``HCCL_SO_PATH`` /
``VLLM_NCCL_SO_PATH``), else the default name resolved by the dynamic loader. The loaded ``CDLL``
and the bound function table are cached per path (class-level, shared by every instance), so
building many communicators never reloads the library.

Every call reads its function from ``self._funcs`` at call time and hands the raw return value to
`CollectiveLibrary.check`, which raises the dialect's typed error (`HcclError` / `NcclError`)
carrying the library's own error string. Integer arguments are range-checked before the call:
ctypes would otherwise wrap a negative count into a huge unsigned one.

Blocking and collective calls: comm init is collective (every rank must call it; it blocks until all
joined or the library's connect timeout); all-reduce, broadcast, all-gather and reduce-scatter are
collective and are *enqueued* on the given stream; send/recv pair up between two ranks; destroy is
local but must not race an operation still running on the communicator.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import platform
import threading
from typing import Any, ClassVar

from ascend_dist.common.errors import ConfigError
from ascend_dist.hccl_ctypes.dialects import HCCL, NCCL, Dialect, Role, hcclComm_t
from ascend_dist.hccl_ctypes.errors import (
    HcclError,
    LibraryLoadError,
    SymbolNotExported,
    UnsupportedDtype,
    UnsupportedOp,
)

__all__ = ["CollectiveLibrary", "HCCLLibrary", "NCCLLibrary", "resolve_library_path"]

logger = logging.getLogger(__name__)


def resolve_library_path(dialect: Dialect, so_file: str | None = None) -> str:
    """Choose the shared library to load: argument, then the dialect's env var, then its default name.

    Args:
        dialect: HCCL or NCCL.
        so_file: Explicit path or name.

    Returns:
        The path (or bare name for the dynamic loader).
    """
    if so_file:
        return so_file
    return os.environ.get(dialect.env_var) or dialect.default_library


def _as_code(result: object) -> int:
    """Normalise a return value (int or a ctypes ``c_int``) to an int."""
    return int(getattr(result, "value", result))  # type: ignore[arg-type]


def _check_uint(field: str, value: int, bits: int) -> int:
    """Reject a value that does not fit the unsigned C type of ``bits`` bits."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < (1 << bits):
        raise ConfigError(field, value, f"an integer in [0, 2**{bits})")
    return value


class CollectiveLibrary:
    """A loaded collective library (HCCL or NCCL) with its symbols bound."""

    path_to_library_cache: ClassVar[dict[str, ctypes.CDLL]] = {}
    path_to_dict_mapping: ClassVar[dict[tuple[str, str], dict[str, Any]]] = {}
    _cache_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, dialect: Dialect, so_file: str | None = None) -> None:
        """Load (or reuse from the cache) the library and bind the dialect's functions.

        Args:
            dialect: `HCCL` or `NCCL`.
            so_file: Path of the shared library; None: the dialect's env var, then its default name.

        Raises:
            LibraryLoadError: The library cannot be loaded (the message names the path and env var),
                or it lacks a required symbol.
        """
        self.dialect = dialect
        self.path = resolve_library_path(dialect, so_file)
        with self._cache_lock:
            lib = self.path_to_library_cache.get(self.path)
            if lib is None:
                try:
                    lib = ctypes.CDLL(self.path)
                except OSError as exc:
                    logger.error(
                        "failed to load %s library %s on %s (%s); set %s to its path",
                        dialect.name, self.path, platform.platform(), exc, dialect.env_var,
                    )  # fmt: skip
                    raise LibraryLoadError(self.path, dialect.env_var, str(exc)) from exc
                self.path_to_library_cache[self.path] = lib
            key = (dialect.name, self.path)
            funcs = self.path_to_dict_mapping.get(key)
            if funcs is None:
                funcs = self._bind(lib)
                self.path_to_dict_mapping[key] = funcs
        self._funcs: dict[str, Any] = funcs

    def _bind(self, lib: ctypes.CDLL) -> dict[str, Any]:
        funcs: dict[str, Any] = {}
        for fn in self.dialect.functions:
            try:
                f = getattr(lib, fn.name)
            except AttributeError as exc:
                if fn.optional:
                    logger.debug("%s does not export optional %s", self.path, fn.name)
                    continue
                raise LibraryLoadError(self.path, self.dialect.env_var, f"missing symbol {fn.name}") from exc
            f.restype = fn.restype
            f.argtypes = fn.argtypes
            funcs[fn.name] = f
        return funcs

    # -- helpers ----------------------------------------------------------------------------------

    def has(self, role: Role) -> bool:
        """Whether the library exports the symbol playing ``role``."""
        name = self.dialect.symbol(role)
        return name is not None and name in self._funcs

    def _func(self, role: Role) -> tuple[str, Any]:
        name = self.dialect.symbol(role)
        if name is None or name not in self._funcs:
            raise SymbolNotExported(name or f"<{self.dialect.name} has no {role.value}>", self.path)
        return name, self._funcs[name]

    def dtype_code(self, dtype: int | enum.IntEnum) -> int:
        """Validate a data-type code of this dialect.

        Raises:
            UnsupportedDtype: Not a member of the dialect's data-type enum.
        """
        try:
            return int(self.dialect.dtype_enum(int(dtype)))
        except (ValueError, TypeError):
            allowed = ", ".join(f"{m.name}={m.value}" for m in self.dialect.dtype_enum)
            raise UnsupportedDtype("datatype", dtype, f"a {self.dialect.name} data type ({allowed})") from None

    def op_code(self, op: int | enum.IntEnum) -> int:
        """Validate a reduce-op code of this dialect.

        Raises:
            UnsupportedOp: Not a member of the dialect's reduce-op enum.
        """
        try:
            return int(self.dialect.op_enum(int(op)))
        except (ValueError, TypeError):
            allowed = ", ".join(f"{m.name}={m.value}" for m in self.dialect.op_enum)
            raise UnsupportedOp("op", op, f"a {self.dialect.name} reduce op ({allowed})") from None

    def get_error_string(self, result: int) -> str:
        """The library's own text for a result code."""
        _, f = self._func(Role.ERROR_STRING)
        raw = f(result)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def check(self, func: str, result: object) -> None:
        """Raise the dialect's typed error when ``result`` is non-zero.

        Raises:
            CollectiveError: (`HcclError` / `NcclError`) with ``func``, the code and the library's string.
        """
        code = _as_code(result)
        if code != 0:
            raise self.dialect.error_type(func, code, self.get_error_string(code))

    # -- calls ------------------------------------------------------------------------------------

    def get_unique_id(self) -> ctypes.Structure:
        """Create a new root info / unique id (the root rank calls this; HCCL needs its device current)."""
        name, f = self._func(Role.UNIQUE_ID)
        uid = self.dialect.id_type()
        self.check(name, f(ctypes.byref(uid)))
        return uid

    def unique_id_from_bytes(self, data: bytes) -> ctypes.Structure:
        """Rebuild an id from the bytes another rank sent.

        Raises:
            ConfigError: ``data`` is not exactly the dialect's id size.
        """
        if len(data) != self.dialect.id_bytes:
            raise ConfigError("unique_id", f"{len(data)} bytes", f"exactly {self.dialect.id_bytes} bytes")
        uid = self.dialect.id_type()
        ctypes.memmove(ctypes.addressof(uid), data, len(data))
        return uid

    def comm_init_rank(self, world_size: int, unique_id: ctypes.Structure, rank: int) -> hcclComm_t:
        """Join the communicator named by ``unique_id`` as ``rank`` of ``world_size`` (collective, blocking).

        Raises:
            ConfigError: ``world_size`` < 1, ``rank`` outside ``[0, world_size)``, or a foreign id type.
            CollectiveError: The library refused (e.g. peers disagree on the world size, or timed out).
        """
        bits = self.dialect.rank_bits
        if _check_uint("world_size", world_size, bits) < 1:
            raise ConfigError("world_size", world_size, "at least 1")
        if not _check_uint("rank", rank, bits) < world_size:
            raise ConfigError("rank", rank, f"a rank in [0, {world_size})")
        if not isinstance(unique_id, self.dialect.id_type):
            raise ConfigError("unique_id", type(unique_id).__name__, self.dialect.id_type.__name__)
        name, f = self._func(Role.COMM_INIT)
        handle = hcclComm_t()
        self.check(name, f(*self.dialect.init_args(world_size, unique_id, rank, ctypes.pointer(handle))))
        return handle

    def all_reduce(  # noqa: PLR0917  (the C prototype's arguments, in order)
        self, send: int, recv: int, count: int, datatype: int, op: int, comm: object, stream: object
    ) -> None:
        """Enqueue an all-reduce of ``count`` elements from ``send`` into ``recv`` on ``stream``."""
        name, f = self._func(Role.ALL_REDUCE)
        count = _check_uint("count", count, self.dialect.count_bits)
        self.check(name, f(send, recv, count, self.dtype_code(datatype), self.op_code(op), comm, stream))

    def broadcast(self, buf: int, count: int, datatype: int, root: int, comm: object, stream: object) -> None:  # noqa: PLR0917  (the C prototype's arguments, in order)
        """Enqueue an in-place broadcast of ``count`` elements of ``buf`` from ``root``."""
        name, f = self._func(Role.BROADCAST)
        count = _check_uint("count", count, self.dialect.count_bits)
        root = _check_uint("root", root, self.dialect.rank_bits)
        self.check(name, f(*self.dialect.broadcast_args(buf, count, self.dtype_code(datatype), root, comm, stream)))  # type: ignore[arg-type]

    def send(self, buf: int, count: int, datatype: int, peer: int, comm: object, stream: object) -> None:  # noqa: PLR0917  (the C prototype's arguments, in order)
        """Enqueue a send of ``count`` elements to ``peer`` (pairs with the peer's `recv`)."""
        self._p2p(Role.SEND, buf, count, datatype, peer, comm, stream)

    def recv(self, buf: int, count: int, datatype: int, peer: int, comm: object, stream: object) -> None:  # noqa: PLR0917  (the C prototype's arguments, in order)
        """Enqueue a receive of ``count`` elements from ``peer`` into ``buf``."""
        self._p2p(Role.RECV, buf, count, datatype, peer, comm, stream)

    def _p2p(self, role: Role, buf: int, count: int, datatype: int, peer: int, comm: object, stream: object) -> None:  # noqa: PLR0917  (the C prototype's arguments, in order)
        name, f = self._func(role)
        count = _check_uint("count", count, self.dialect.count_bits)
        peer = _check_uint("peer", peer, self.dialect.rank_bits)
        self.check(name, f(buf, count, self.dtype_code(datatype), peer, comm, stream))

    def all_gather(self, send: int, recv: int, send_count: int, datatype: int, comm: object, stream: object) -> None:  # noqa: PLR0917  (the C prototype's arguments, in order)
        """Enqueue an all-gather: ``recv`` receives ``world_size * send_count`` elements, rank-ordered."""
        name, f = self._func(Role.ALL_GATHER)
        send_count = _check_uint("send_count", send_count, self.dialect.count_bits)
        self.check(name, f(send, recv, send_count, self.dtype_code(datatype), comm, stream))

    def reduce_scatter(  # noqa: PLR0917  (the C prototype's arguments, in order)
        self, send: int, recv: int, recv_count: int, datatype: int, op: int, comm: object, stream: object
    ) -> None:
        """Enqueue a reduce-scatter: ``recv`` gets this rank's ``recv_count``-element slice of the reduction."""
        name, f = self._func(Role.REDUCE_SCATTER)
        recv_count = _check_uint("recv_count", recv_count, self.dialect.count_bits)
        self.check(name, f(send, recv, recv_count, self.dtype_code(datatype), self.op_code(op), comm, stream))

    def comm_destroy(self, comm: object) -> None:
        """Release a communicator (local; nothing may still run on it)."""
        name, f = self._func(Role.DESTROY)
        self.check(name, f(comm))

    def comm_abort(self, comm: object) -> None:
        """Abort a communicator, cancelling pending operations.

        Raises:
            SymbolNotExported: The dialect or library has no abort (HCCL): use `comm_destroy`.
        """
        name, f = self._func(Role.ABORT)
        self.check(name, f(comm))


class HCCLLibrary(CollectiveLibrary):
    """The HCCL dialect, with the camelCase methods of upstream ``pyhccl_wrapper`` for parity."""

    def __init__(self, so_file: str | None = None) -> None:
        """Load ``so_file`` (None: ``HCCL_SO_PATH``, then ``libhccl.so``) and bind the HCCL symbols."""
        super().__init__(HCCL, so_file)

    def hcclGetErrorString(self, result: int) -> str:  # noqa: N802  (upstream name)
        """See `CollectiveLibrary.get_error_string`."""
        return self.get_error_string(result)

    def HCCL_CHECK(self, result: object) -> None:  # noqa: N802  (upstream name)
        """Raise on a non-zero ``result`` with upstream's message, ``HCCL error: <library string>``.

        Raises:
            HcclError: a ``RuntimeError``, as upstream raises, with ``code`` and ``func`` set.
        """
        code = _as_code(result)
        if code != 0:
            raise HcclError.upstream(code, self.get_error_string(code))

    # Upstream's collective names: the same calls as the snake_case ones (buffers and streams may be
    # ctypes objects, as upstream passes them: ``buffer_type(t.data_ptr())``, ``aclrtStream_t(...)``).

    def hcclAllReduce(  # noqa: N802, PLR0917  (upstream name; the C prototype's arguments, in order)
        self, sendbuff: object, recvbuff: object, count: int, datatype: int, op: int, comm: object, stream: object
    ) -> None:
        """See `CollectiveLibrary.all_reduce`."""
        self.all_reduce(sendbuff, recvbuff, count, datatype, op, comm, stream)  # type: ignore[arg-type]

    def hcclBroadcast(  # noqa: N802, PLR0917  (upstream name; the C prototype's arguments, in order)
        self, buf: object, count: int, datatype: int, root: int, comm: object, stream: object
    ) -> None:
        """See `CollectiveLibrary.broadcast`."""
        self.broadcast(buf, count, datatype, root, comm, stream)  # type: ignore[arg-type]

    def hcclAllGather(  # noqa: N802, PLR0917  (upstream name; the C prototype's arguments, in order)
        self, sendbuff: object, recvbuff: object, sendcount: int, datatype: int, comm: object, stream: object
    ) -> None:
        """See `CollectiveLibrary.all_gather`."""
        self.all_gather(sendbuff, recvbuff, sendcount, datatype, comm, stream)  # type: ignore[arg-type]

    def hcclSend(  # noqa: N802, PLR0917  (upstream name; the C prototype's arguments, in order)
        self, sendbuff: object, count: int, datatype: int, dest: int, comm: object, stream: object
    ) -> None:
        """See `CollectiveLibrary.send`."""
        self.send(sendbuff, count, datatype, dest, comm, stream)  # type: ignore[arg-type]

    def hcclRecv(  # noqa: N802, PLR0917  (upstream name; the C prototype's arguments, in order)
        self, recvbuff: object, count: int, datatype: int, src: int, comm: object, stream: object
    ) -> None:
        """See `CollectiveLibrary.recv`."""
        self.recv(recvbuff, count, datatype, src, comm, stream)  # type: ignore[arg-type]

    def hcclGetUniqueId(self) -> ctypes.Structure:  # noqa: N802  (upstream name)
        """See `CollectiveLibrary.get_unique_id`."""
        return self.get_unique_id()

    def hcclCommInitRank(self, world_size: int, unique_id: ctypes.Structure, rank: int) -> hcclComm_t:  # noqa: N802
        """See `CollectiveLibrary.comm_init_rank`."""
        return self.comm_init_rank(world_size, unique_id, rank)

    def hcclCommDestroy(self, comm: object) -> None:  # noqa: N802  (upstream name)
        """See `CollectiveLibrary.comm_destroy`."""
        self.comm_destroy(comm)


class NCCLLibrary(CollectiveLibrary):
    """The NCCL dialect of the same binding (CUDA hosts)."""

    def __init__(self, so_file: str | None = None) -> None:
        """Load ``so_file`` (None: ``VLLM_NCCL_SO_PATH``, then ``libnccl.so.2``) and bind the NCCL symbols."""
        super().__init__(NCCL, so_file)
