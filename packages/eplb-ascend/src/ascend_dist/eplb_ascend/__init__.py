"""ascend_dist.eplb_ascend: dynamic expert load balancing (EPLB) state and expert-weight transport.

Importing the package imports nothing heavy. Modules by role:

- planning (numpy only): `placement`, `routing`, `transfer_plan`, `policy`;
- worker (torch): `tables` (routing tables refreshed in place), `transport` (`P2PTransport`, gloo,
  the device seam), `communicator`, `mover`, `controller`, `state`;
- vLLM adapter: `vllm_eplb` (the only module importing vllm);
- demo/bench (in `_demo`, never imported by the modules above): `scenario`, `worker`, `launch`.
"""

__all__: list[str] = []
