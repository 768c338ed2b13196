"""Pool backends behind one Protocol: Mooncake Store, openYuanrong datasystem, memcache, in-memory.

Runs in: worker processes (and the scheduler for layer-wise lookups). Backends are selected by
name with `create_backend`, which imports the native client lazily.
"""

from ascend_dist.kv_store.backends.base import (
    MOONCAKE_CODES,
    PoolBackend,
    TransferBatch,
    UnsupportedOperation,
    normalize_get_codes,
)
from ascend_dist.kv_store.backends.factory import create_backend
from ascend_dist.kv_store.backends.memory import InMemoryBackend

__all__ = [
    "MOONCAKE_CODES",
    "InMemoryBackend",
    "PoolBackend",
    "TransferBatch",
    "UnsupportedOperation",
    "create_backend",
    "normalize_get_codes",
]
