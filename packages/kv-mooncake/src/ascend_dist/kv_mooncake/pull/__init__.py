"""The pull connector: D reads a finished prompt's KV from P (``MooncakeConnectorV1``, ``MooncakeHybridConnector``).

Modules by role: `config` (settings), `messages` (its wire on `core.messages`, and the params P
hands D), `plan_groups` / `cp_plan` / `pull_batch` / `pull_descriptors` (pure planning),
`scheduler` (scheduler side, both roles), `worker` / `threads` / `peers` / `tracker` (worker
side; `tracker` is P's per-request state table), `vllm_connector` (the only module that imports
vLLM).
"""

__all__: list[str] = []
