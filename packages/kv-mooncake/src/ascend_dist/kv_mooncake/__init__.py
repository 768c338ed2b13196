"""ascend_dist.kv_mooncake: prefill/decode KV-cache transfer over the Mooncake transfer engine.

Three transports on one core (each subpackage's docstring lists its modules by role):

- `pull` - ``MooncakeConnectorV1`` / ``MooncakeHybridConnector``: D pulls a finished prompt's KV
  (attention, sliding-window and state groups) from P.
- `push` - ``MooncakeLayerwiseConnector``: P writes each layer into D's blocks while it prefills.
- `sfa` - ``SfaRemoteD2HConnector``: D reads each layer from P's device memory into a host pool.
- `core` - what all three share: config base, hostile-input admission, wire pieces, the Mooncake
  engine adapter, KV geometry, the request type and the vLLM glue. It never imports a transport,
  and no transport imports another.
- `_demo` - synthetic models, peer processes and the ``pd*`` scenarios, reached only through the
  ``ascend_dist.scenarios`` entry points (and tests); library modules never import it.

The paths users put in ``kv_connector_module_path`` (`ascend_dist.kv_mooncake.vllm_connector`,
`ascend_dist.kv_mooncake.layerwise.vllm_connector`, `ascend_dist.kv_mooncake.sfa.vllm_connector`)
keep working. Importing this package imports nothing heavy; import the modules you use.
"""

__all__: list[str] = []
