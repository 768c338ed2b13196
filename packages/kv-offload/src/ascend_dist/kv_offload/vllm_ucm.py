"""vLLM adapter of the UCM connector wrapper: ``UCMConnector``.

Runs in: vLLM's scheduler and worker processes. The only module of the UCM path that imports
vLLM. Every hook delegates to UCM's own dispatcher by the rules in `ucm.UcmDelegate`. Without
``uc-manager`` installed, construction raises `UcmUnavailable`, which says what to install.

Configure with ``kv_connector_extra_config``: ``UCM_CONFIG_FILE`` (UCM's YAML, read by UCM), and
optionally ``ucm_module_path`` / ``ucm_class_name`` to point at another UCM release's connector.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA

from ascend_dist.kv_offload.ucm import (
    DEFAULT_UCM_CLASS,
    DEFAULT_UCM_MODULE,
    UcmDelegate,
    UcmUnavailable,
    load_dispatcher_class,
)

__all__ = ["UCMConnector"]


class UCMConnector(KVConnectorBase_V1, SupportsHMA):
    """Delegating wrapper around UCM's connector (external DRAM/POSIX/NFS/3FS KV store)."""

    dispatcher_cls: ClassVar[type | None] = None
    """UCM's connector class; None: import it from the configured module (tests set a fake)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        """Build UCM's dispatcher with the same arguments.

        Raises:
            UcmUnavailable: UCM is not installed (the message says how to install it).
        """
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        cls = self.dispatcher_cls or load_dispatcher_class(
            extra.get("ucm_module_path", DEFAULT_UCM_MODULE), extra.get("ucm_class_name", DEFAULT_UCM_CLASS)
        )
        self.ucm = UcmDelegate(cls, vllm_config, role, kv_cache_config)

    @classmethod
    def _ucm_class(cls) -> type | None:
        """UCM's connector class, or None when UCM is not installed."""
        try:
            return cls.dispatcher_cls or load_dispatcher_class()
        except UcmUnavailable:
            return None

    # -- core hooks: always the dispatcher --------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("register_kv_caches", kv_caches)

    def has_connector_metadata(self) -> bool:
        """Delegates to UCM (see the module docstring)."""
        return bool(self.ucm.core("has_connector_metadata"))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("bind_connector_metadata", connector_metadata)

    def clear_connector_metadata(self) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("clear_connector_metadata")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("start_load_kv", forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("wait_for_layer_load", layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("save_kv_layer", layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("wait_for_save")

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.core("get_block_ids_with_load_errors")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.core("get_finished", finished_req_ids)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.core("get_num_new_matched_tokens", request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("update_state_after_alloc", request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.core("build_connector_meta", scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.core("update_connector_output", connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.core("request_finished", request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.request_finished_all_groups(request, block_ids)

    # -- reserved hooks: own class, else inner connector, else inherited --------------------------------

    def shutdown(self) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.reserved("shutdown")

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.reserved("set_host_xfer_buffer_ops", copy_operation)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.reserved("handle_preemptions", kv_connector_metadata)

    def build_connector_worker_meta(self) -> Any:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.reserved("build_connector_worker_meta")

    def take_events(self) -> Any:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.take_events()

    def get_kv_connector_stats(self) -> Any:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.reserved("get_kv_connector_stats")

    def get_kv_connector_kv_cache_events(self) -> Any:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.reserved("get_kv_connector_kv_cache_events")

    def get_handshake_metadata(self) -> Any:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.reserved("get_handshake_metadata")

    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        """Delegates to UCM (see the module docstring)."""
        self.ucm.reserved("set_xfer_handshake_metadata", metadata)

    def get_finished_count(self) -> int | None:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.reserved("get_finished_count")

    def reset_cache(self) -> bool | None:
        """Delegates to UCM (see the module docstring)."""
        return self.ucm.reserved("reset_cache")

    # -- class-level: UCM's class ------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        """UCM's stats builder, or None without UCM."""
        ucm = cls._ucm_class()
        builder = getattr(ucm, "build_kv_connector_stats", None)
        return builder(data) if callable(builder) else None

    @classmethod
    def build_prom_metrics(cls, *args: Any, **kwargs: Any) -> Any:
        """UCM's Prometheus metrics builder, or None without UCM."""
        ucm = cls._ucm_class()
        builder = getattr(ucm, "build_prom_metrics", None)
        return builder(*args, **kwargs) if callable(builder) else None
