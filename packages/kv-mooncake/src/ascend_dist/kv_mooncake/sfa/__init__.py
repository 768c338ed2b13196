"""``SfaRemoteD2HConnector``: D reads each layer from P's device memory into its host pool.

For sparse-attention (SFA/DSA, MLA-style) models whose decode instance keeps the main KV cache in a
host pool shared by its TP ranks and only the small indexer cache on the device. D reads each layer
while P is still prefilling; P only says when a layer is readable and holds the layer's storage
until D's answer (its reuse gate). Modules by role: `config`, `plan` (pure), `messages` (its wire on
`core.messages`, and the contact info D posts), `scheduler` (both halves; D posts through
`core.metaserver`), `step_metadata` (what they hand the workers), `producer` / `links` (P worker and
its send threads), `consumer` (D worker and its read thread), `backend` (picks the `core.engine`
`Reader`: MemFabric or Mooncake), `vllm_connector` (the only module importing vLLM). The ``pd-sfa``
demo and bench live in `ascend_dist.kv_mooncake._demo` (`sfa_synthetic`, `sfa_peer`,
`sfa_peer_process`, `sfa_scenario`).
"""

__all__: list[str] = []
