"""Real vLLM engines generating tokens on the CPU, for the engine test tier and `ascend-dist demo --engine vllm`.

Runs in: the caller's process (`EngineHost`, `disaggregated`), and in the engine environment's
Python (`zygote`, `model`): vLLM's CPU build over torch 2.13, built by ``tools/engine_env.py``.

Importing vLLM costs ~25 s of CPU here, so one *zygote* process imports it once and forks each
engine from there (~8 s to a serving engine). Every engine keeps its engine core in its own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so killing an engine really kills its connector. Messages
between the caller, the zygote and the engines are msgspec JSON lines: nothing is unpickled.
"""
