"""vLLM general plugin: registers the installed ascend_dist components with vLLM, lazily.

Runs in: every vLLM process (entry-point group `vllm.general_plugins`), possibly more than once.
`register()` is re-entrant, imports no connector module and nothing heavy, skips components that
are not installed, keeps a name someone else registered first (with one warning), and never raises:
an exception here would abort vLLM's start-up.
"""

from __future__ import annotations

import importlib.util
import logging
import threading

__all__ = ["KV_CONNECTORS", "register", "registered_names"]

logger = logging.getLogger(__name__)

# (name used in --kv-transfer-config, module path, class name). The names are vllm-ascend's, so
# existing deployment configs keep working. A row whose module is not installed is skipped.
KV_CONNECTORS: tuple[tuple[str, str, str], ...] = (
    ("MooncakeConnectorV1", "ascend_dist.kv_mooncake.vllm_connector", "MooncakeConnectorV1"),
    ("MooncakeLayerwiseConnector", "ascend_dist.kv_mooncake.vllm_layerwise", "MooncakeLayerwiseConnector"),
    ("MooncakeHybridConnector", "ascend_dist.kv_mooncake.vllm_hybrid", "MooncakeHybridConnector"),
    ("SfaRemoteD2HConnector", "ascend_dist.kv_mooncake.vllm_sfa", "SfaRemoteD2HConnector"),
    ("AscendStoreConnector", "ascend_dist.kv_store.vllm_connector", "AscendStoreConnector"),
    ("MooncakeConnectorStoreV1", "ascend_dist.kv_store.vllm_connector", "AscendStoreConnector"),
    ("RecomputeCPUOffloadConnector", "ascend_dist.kv_offload.vllm_recompute", "RecomputeCPUOffloadConnector"),
    ("UCMConnector", "ascend_dist.kv_offload.vllm_ucm", "UCMConnector"),
)

_lock = threading.Lock()
_registered: set[str] = set()
_done = threading.Event()


def _installed(module_path: str) -> bool:
    try:
        return importlib.util.find_spec(module_path) is not None
    except (ImportError, ValueError):  # a missing parent package raises instead of returning None
        return False


def _register_kv_connectors() -> None:
    rows = [row for row in KV_CONNECTORS if _installed(row[1])]
    if not rows:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module_path, class_name in rows:
        try:
            KVConnectorFactory.register_connector(name, module_path, class_name)
        except ValueError:
            logger.warning("KV connector %s is already registered by another plugin; keeping that one", name)
            continue
        _registered.add(name)


def register() -> None:
    """Register every installed component with vLLM; safe to call any number of times."""
    with _lock:
        if _done.is_set():
            return
        _done.set()
        try:
            _register_kv_connectors()
        except Exception:  # never abort vLLM's start-up because of us
            logger.exception("ascend_dist plugin registration failed; ascend_dist connectors are unavailable")


def registered_names() -> frozenset[str]:
    """The connector names this process registered (for diagnostics and tests)."""
    return frozenset(_registered)
