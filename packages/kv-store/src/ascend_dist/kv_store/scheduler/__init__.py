"""The scheduler side: prefix lookups, load specs, request trackers and each step's metadata.

Modules by role: `scheduler` (`KVPoolScheduler`), `requests` (its per-request table: one record and
one checked state per request), `plan` (request trackers, building each request's `ReqMeta`, hit
helpers). What it hands the workers lives in the top-level `step_metadata`. May import
`config/`, `keys/` and `step_metadata`; never `lookup/` or `transfer/` (the lookup reaches it as a
callable the composition root wires in).
"""

__all__: list[str] = []
