"""The pull connector: D reads a finished prompt's KV from P (``MooncakeConnectorV1``, ``MooncakeHybridConnector``).

Modules by role: `config` (settings), `messages` (its wire on `core.messages`, and the params P
hands D), pure planning: `sources` (which P ranks), `block_pairs` (D/P block pairs per group
kind), `slice_bytes` / `state_bytes` (the bytes of a head slice / a state block), `cp_plan`
(context parallelism), `task_batch` (one task's descriptors over all of them);
`scheduler` (scheduler side, both roles), `step_metadata` (what it hands the workers each step),
`worker` / `threads` / `peers` / `tracker` / `d_requests` (worker side; `tracker` is P's and
`d_requests` D's per-request state table), `vllm_connector` (the only module that imports
vLLM).
"""

__all__: list[str] = []
