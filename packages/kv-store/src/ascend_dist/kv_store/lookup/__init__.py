"""The prefix lookup: how many leading prompt tokens every rank can load from the pool.

Modules by role: `messages` (the RPC's wire protocol), `lookup_rpc` (`LookupServer` on the rank-0
worker, `LookupClient` in the scheduler), `lookup_endpoint` (where the server publishes its
endpoint, per instance, in a private directory), `lookup_breaker` (the client's circuit breaker),
`pool_lookup` (the lookup itself, over the backend). May
import `config/`, `keys/` and `backends/`; never `scheduler/` or `transfer/`.
"""

__all__: list[str] = []
