"""What pull, push and SFA share; imports no transport.

Modules by role: `config` (the config base: shared keys, field parsers, topology), `admission`
(bounds on a client's ``kv_transfer_params``), `wire` (the message base, tag, version and codec
factory of every side channel), `messages` (the messages the transports share, the handshake
rule, tensor metadata, prompt digest), `metaserver` (the one client of the proxy's metaserver),
`engine` (the transfer-engine Protocol and the Mooncake adapter), `ranks` (rank and head-slice
selection), `blocks` / `kv_geometry` (pure block and tensor math), `descriptors` (P2P copy
descriptors), `mappings` / `ports` (TP/PP/CP mappings, side-channel ports), `transfer_records` /
`transfer_mappings` / `transfer_placement` (the layer-wise transfer plan) and `kv_views` (labelled views
of vLLM's KV tensors), `request` (the request as the scheduler side sees it), `vllm_glue` (the
vLLM glue all three adapters use: the only module here that touches vLLM objects).
"""

__all__: list[str] = []
