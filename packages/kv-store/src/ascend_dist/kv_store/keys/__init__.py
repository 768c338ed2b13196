"""Naming what is in the pool: keys, token chunks and their hashes, re-keying across parallel layouts.

Modules by role: `keys` (key metadata and key strings, which rank writes which key), `token_db`
(token ranges <-> chunk hashes <-> keys <-> device addresses), `rekey` / `tp_mismatch` (one rank's
chunk as another TP/PP layout's keys), `coordinator` (which chunks each hybrid-model KV group needs;
used by the lookup and the transfers, so it lives below both). May import `config/` only.
"""

__all__: list[str] = []
