"""The layer-wise push connector (``MooncakeLayerwiseConnector``).

D registers and announces its blocks first (to the proxy's metaserver); P writes each layer into
D's blocks as soon as the layer is saved, so the transfer overlaps the prefill. Modules by role:
`config` (settings), `plan` (pure planning over `ascend_dist.kv_mooncake.core.transfer_mappings`),
`messages` (its wire on `core.messages`, and the params D announces), `scheduler` (scheduler
side; announces through `core.metaserver`), `step_metadata` (what it hands the workers),
`worker` / `producer` / `sender` / `receiver` / `gate` / `reshard` (worker side; bytes move
through `core.engine`'s `Writer`), `vllm_connector` (the only module that imports vLLM).
"""

__all__: list[str] = []
