"""The worker side: buffer registration, loads and saves (whole-request and layer-wise), completion, failures.

Modules by role: `worker` (`KVPoolWorker`), `worker_types` (its small shared types), `registration`
(KV-cache buffers -> regions), `chunk_plan` / `whole_request` (the whole-request path), `load_batches`
(gets without repeated keys, calls under the piece cap; used by both paths), `layerwise` /
`gva_layerwise` / `layerwise_plan` / `gate` (the layer-wise paths), `transfer` (background threads,
completion tracking), `failures` / `events` (load failures, KV events). May import `config/`,
`keys/`, `backends/` and `step_metadata`; never `scheduler/`. One documented exception: `worker`
imports `lookup.pool_lookup`, because the rank-0 worker answers the scheduler's lookups from its own
backend.
"""

__all__: list[str] = []
