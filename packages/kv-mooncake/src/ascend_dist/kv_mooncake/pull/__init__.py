"""The pull connector: D reads a finished prompt's KV from P (``MooncakeConnectorV1``, ``MooncakeHybridConnector``).

Modules by role: `config` (settings), `messages` (its wire on `core.messages`, and the params P
hands D), pure planning: `sources` (which P ranks), `block_pairs` (D/P block pairs per group
kind), `slice_bytes` / `state_bytes` (the bytes of a head slice / a state block), `cp_plan`
(context parallelism), `task_batch` (one task's descriptors over all of them);
`scheduler` (scheduler side, both roles), `worker` / `threads` / `peers` / `tracker` (worker
side; `tracker` is P's per-request state table), `vllm_connector` (the only module that imports
vLLM).
"""

__all__: list[str] = []
