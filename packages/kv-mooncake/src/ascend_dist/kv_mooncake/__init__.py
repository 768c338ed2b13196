"""ascend_dist.kv_mooncake: prefill/decode KV-cache transfer over the Mooncake transfer engine.

``MooncakeConnectorV1`` (vLLM adapter: `ascend_dist.kv_mooncake.vllm_connector`) lets a decode
instance pull a prompt's KV cache from the prefill instance that computed it. Modules by role:
`config` (settings), `plan` (pure planning), `messages` (wire), `scheduler` (scheduler side),
`worker` / `threads` / `tracker` / `engine` (worker side), `vllm_connector` (the only module that
imports vLLM), `synthetic` / `pd_peer` / `peer_process` / `scenario_pd` (the ``pd`` demo and bench).

Importing this package imports nothing heavy; import the modules you use.
"""

__all__: list[str] = []
