"""openYuanrong datasystem backend over ``yr.datasystem.KVClient`` (host memory only).

Runs in: worker processes. Upstream used ``HeteroClient`` (device-memory H2D/D2H, needs an NPU); on
a CPU host the same contract is met with the plain KV client: ``put`` gathers each key's pieces into
one value and ``set``s it, ``get`` fetches values and scatters them into the pieces. Both copies go
through host pointers (``ctypes``), so KV caches in device memory (NPU, CUDA) are refused at start
with a `ConfigError`: dereferencing a device address on the host would crash the worker on its
first save. (The installed package's ``HeteroClient`` is not wired here: it needs an NPU to test.) Results follow
the Mooncake conventions (0 ok, -704 missing, -600 size mismatch) so the worker treats every backend
alike. Keys are the pool's key strings unchanged (no normalisation, unlike the drifted docs).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ascend_dist.common.errors import ConfigError, StoreError
from ascend_dist.kv_store.backends.base import INVALID_PARAMS, OBJECT_NOT_FOUND
from ascend_dist.kv_store.config.config import YuanrongConfig

__all__ = ["YuanrongBackend", "YuanrongKVClient"]

logger = logging.getLogger(__name__)


class YuanrongKVClient(Protocol):
    """The subset of ``yr.datasystem.KVClient`` this backend calls."""

    def init(self) -> None:
        """Native call."""
        ...

    def exist(self, keys: list[str]) -> list[bool]:
        """Native call."""
        ...

    def set(self, key: str, val: bytes) -> Any:
        """Native call."""
        ...

    def get(self, keys: list[str], convert_to_str: bool = False, sub_timeout_ms: int = 0) -> list[bytes]:
        """Native call."""
        ...


def _load_mooncake_first() -> None:
    """Import Mooncake's native module (when installed) before openYuanrong's.

    Measured with mooncake-transfer-engine-non-cuda 0.3.13 and openyuanrong-datasystem 0.8.1: importing
    ``yr.datasystem`` first makes a later ``import mooncake.store`` in the same process crash with
    SIGSEGV; the other order works. Both may meet in one process (tests, the demo, a node running
    both backends), so the safe order is forced here.
    """
    with contextlib.suppress(ImportError):  # Mooncake not installed: nothing to order
        import mooncake.store  # noqa: F401  # pyright: ignore[reportUnusedImport]


def _default_factory(cfg: YuanrongConfig) -> YuanrongKVClient:
    _load_mooncake_first()
    from yr.datasystem import KVClient  # native; imported only when used

    return KVClient(
        cfg.host, cfg.port, connect_timeout_ms=cfg.connect_timeout_ms, req_timeout_ms=cfg.request_timeout_ms
    )


class YuanrongBackend:
    """A `PoolBackend` over an openYuanrong datasystem worker."""

    name = "yuanrong"

    def __init__(
        self,
        config: YuanrongConfig,
        *,
        memory_kind: str = "cpu",
        client_factory: Callable[[YuanrongConfig], YuanrongKVClient] = _default_factory,
    ) -> None:
        """Connect to the worker.

        Args:
            config: Client settings.
            memory_kind: Where the KV caches live: the device runtime's backend name; only
                ``cpu`` (host memory) is accepted.
            client_factory: Creates the native client.

        Raises:
            ConfigError: The KV caches are in device memory (checked before connecting).
            StoreError: The worker cannot be reached (``init`` failed).
        """
        if memory_kind != "cpu":
            raise ConfigError(
                "backend",
                "yuanrong",
                f"a backend that can reach {memory_kind} device memory (mooncake or memcache): the openYuanrong "
                "KV client copies through host pointers and the KV caches are not in host memory",
            )
        self._cfg = config
        self._client = client_factory(config)
        try:
            self._client.init()
        except RuntimeError as exc:
            raise StoreError(f"openYuanrong worker {config.host}:{config.port} unreachable: {exc}") from exc

    def register_buffer(self, ptrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Nothing to register: values are copied through host memory."""

    def exists(self, keys: Sequence[str]) -> list[int]:
        """1/0 per key.

        Raises:
            StoreError: The worker failed the query.
        """
        if not keys:
            return []
        try:
            found = self._client.exist(list(keys))
        except RuntimeError as exc:
            raise StoreError(f"openYuanrong exist failed: {exc}") from exc
        return [1 if f else 0 for f in found]

    def put(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Gather and ``set`` each key; -1 for a key the worker refused."""
        codes: list[int] = []
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes, strict=True):
            value = b"".join(ctypes.string_at(a, s) for a, s in zip(key_addrs, key_sizes, strict=True))
            try:
                self._client.set(key, value)
                codes.append(0)
            except RuntimeError as exc:
                logger.warning("openYuanrong set of %s failed: %s", key, exc)
                codes.append(-1)
        return codes

    def get(self, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]) -> list[int]:
        """Fetch each key and scatter it: -704 missing, -600 size mismatch."""
        codes: list[int] = []
        for key, key_addrs, key_sizes in zip(keys, addrs, sizes, strict=True):
            try:
                value = self._client.get([key], False, 0)[0]
            except RuntimeError:
                codes.append(OBJECT_NOT_FOUND)
                continue
            if len(value) != sum(key_sizes):
                codes.append(INVALID_PARAMS)
                continue
            view = memoryview(value)
            pos = 0
            for addr, size in zip(key_addrs, key_sizes, strict=True):
                ctypes.memmove(addr, bytes(view[pos : pos + size]), size)
                pos += size
            codes.append(0)
        return codes

    def close(self) -> None:
        """The KV client closes with the process; nothing to release."""
