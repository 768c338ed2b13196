"""ascend_dist.kv_mooncake: prefill/decode KV-cache transfer over the Mooncake transfer engine.

``MooncakeConnectorV1`` and ``MooncakeHybridConnector`` (vLLM adapter:
`ascend_dist.kv_mooncake.vllm_connector`) let a decode instance pull a prompt's KV cache
(attention, sliding-window and state groups) from the prefill instance that computed it. Modules
by role: `config` (settings; `config_common` holds the parsing the pull, layer-wise and SFA
connectors share), `plan` / `plan_groups` / `cp_plan` / `pull_batch` / `pull_descriptors` /
`kv_geometry` (pure planning; `kv_geometry` reads a KV tensor's block geometry from its strides
for all three connectors), `messages` (wire), `scheduler` (scheduler side), `worker` / `threads` /
`peers` / `tracker` / `engine` / `kv_views` (worker side; `kv_views` splits and labels the
engine's tensors), `vllm_connector` / `vllm_common` (the only modules that import vLLM; the
latter is shared by the three adapters), `synthetic` / `synthetic_layouts` / `synthetic_state` /
`synthetic_common` / `pd_peer` / `peer_process` / `peer_serve` / `scenario_pd` (the ``pd`` demo
and bench; the peer and synthetic helpers are shared with the subpackages' demos).

Importing this package imports nothing heavy; import the modules you use.
"""

__all__: list[str] = []
