"""ascend_dist.kv_store: AscendStore, a cluster-wide KV-cache prefix pool for vLLM.

The scheduler side asks the pool how many leading prompt tokens it holds and plans loads and
saves; each worker moves whole chunks between its paged KV cache and the store (Mooncake Store,
openYuanrong datasystem, or memcache on Ascend). The vLLM adapter lives in
``ascend_dist.kv_store.vllm_connector`` (the only module importing vllm).

Importing this package is cheap (no torch, no native clients): the names below load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ascend_dist.kv_store.assembly import PoolSpec, build_scheduler, build_worker
    from ascend_dist.kv_store.backends import InMemoryBackend, PoolBackend, create_backend
    from ascend_dist.kv_store.config.config import MooncakeStoreConfig, PoolConfig, YuanrongConfig
    from ascend_dist.kv_store.config.sizes import DerivedSizes
    from ascend_dist.kv_store.keys.keys import KeyMetadata, RankLayout, normalize_model_name
    from ascend_dist.kv_store.keys.token_db import ChunkedTokenDatabase, prefix_hashes
    from ascend_dist.kv_store.lookup.lookup_rpc import LookupClient, LookupServer
    from ascend_dist.kv_store.scheduler.plan import RequestTracker
    from ascend_dist.kv_store.scheduler.scheduler import KVPoolScheduler, NewRequest, RunningRequest, StepInput
    from ascend_dist.kv_store.step_metadata import LoadSpec, PoolStepMeta, ReqMeta
    from ascend_dist.kv_store.transfer.worker import KVPoolWorker

_LAZY: dict[str, str] = {
    "ChunkedTokenDatabase": "ascend_dist.kv_store.keys.token_db",
    "DerivedSizes": "ascend_dist.kv_store.config.sizes",
    "InMemoryBackend": "ascend_dist.kv_store.backends",
    "KVPoolScheduler": "ascend_dist.kv_store.scheduler.scheduler",
    "KVPoolWorker": "ascend_dist.kv_store.transfer.worker",
    "KeyMetadata": "ascend_dist.kv_store.keys.keys",
    "LoadSpec": "ascend_dist.kv_store.step_metadata",
    "LookupClient": "ascend_dist.kv_store.lookup.lookup_rpc",
    "LookupServer": "ascend_dist.kv_store.lookup.lookup_rpc",
    "MooncakeStoreConfig": "ascend_dist.kv_store.config.config",
    "NewRequest": "ascend_dist.kv_store.scheduler.scheduler",
    "PoolBackend": "ascend_dist.kv_store.backends",
    "PoolConfig": "ascend_dist.kv_store.config.config",
    "PoolSpec": "ascend_dist.kv_store.assembly",
    "PoolStepMeta": "ascend_dist.kv_store.step_metadata",
    "RankLayout": "ascend_dist.kv_store.keys.keys",
    "ReqMeta": "ascend_dist.kv_store.step_metadata",
    "RequestTracker": "ascend_dist.kv_store.scheduler.plan",
    "RunningRequest": "ascend_dist.kv_store.scheduler.scheduler",
    "StepInput": "ascend_dist.kv_store.scheduler.scheduler",
    "YuanrongConfig": "ascend_dist.kv_store.config.config",
    "build_scheduler": "ascend_dist.kv_store.assembly",
    "build_worker": "ascend_dist.kv_store.assembly",
    "create_backend": "ascend_dist.kv_store.backends",
    "normalize_model_name": "ascend_dist.kv_store.keys.keys",
    "prefix_hashes": "ascend_dist.kv_store.keys.token_db",
}

__all__ = [
    "ChunkedTokenDatabase",
    "DerivedSizes",
    "InMemoryBackend",
    "KVPoolScheduler",
    "KVPoolWorker",
    "KeyMetadata",
    "LoadSpec",
    "LookupClient",
    "LookupServer",
    "MooncakeStoreConfig",
    "NewRequest",
    "PoolBackend",
    "PoolConfig",
    "PoolSpec",
    "PoolStepMeta",
    "RankLayout",
    "ReqMeta",
    "RequestTracker",
    "RunningRequest",
    "StepInput",
    "YuanrongConfig",
    "build_scheduler",
    "build_worker",
    "create_backend",
    "normalize_model_name",
    "prefix_hashes",
]


def __getattr__(name: str) -> Any:  # PEP 562: import the defining module on first access
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ascend_dist.kv_store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
