"""Host memory of the offload connectors in real vLLM engines, against their configured capacity.

Runs in: the caller's process (engine environment or workspace); the engines run under the engine
environment's Python (``$ASCEND_DIST_ENGINE_PYTHON``, else this interpreter). Run it with
``.nox/engine-env/bin/python -m ascend_dist.cli.engines.offload_bench [--capacity-mib 32]``.

Per connector, two engines with the same tiny device KV cache and the same workload: one with
``cpu_bytes_to_use`` = the capacity, one with a floor capacity of one device block. Both get the same
distinct prompts (more KV than the capacity holds, so the host cache is full), then their memory is
read from ``/proc/<pid>/smaps_rollup``. ``(Rss(capacity) - Rss(floor)) / (capacity - floor)`` is the
share of the configured bytes the host cache really occupies: the two engines differ only in the
capacity, so code, imports and the device cache cancel out. The same difference against an engine
without any connector is reported too (it adds the connector's own overhead).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ascend_dist.cli.engines.host import Engine, EngineHost, engine_python
from ascend_dist.cli.engines.wire import EngineSpec, Prompt

__all__ = [
    "BLOCK_TOKENS",
    "CONNECTORS",
    "DEVICE_BLOCKS",
    "MemoryRow",
    "fill_prompts",
    "measure_memory",
    "offload_config",
    "offload_spec",
    "process_memory",
    "render_rows",
]

CONNECTORS = ("AscendOffloadingConnector", "AscendSimpleCPUOffloadConnector", "RecomputeCPUOffloadConnector")
"""The offload family, by the names our vLLM plugin registers."""

DEVICE_BLOCKS = 24
"""Device KV blocks of every engine here (768 tokens): small enough that prefixes are evicted."""

BLOCK_TOKENS = 32
FILL_PROMPT_TOKENS = 480  # 15 blocks: fits the device cache with room for its output
MAX_MODEL_LEN = 512


def offload_config(connector: str, capacity_bytes: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``kv_transfer_config`` (vLLM's dict) of one offload connector with ``capacity_bytes`` of host memory.

    No ``spec_name`` for the native connector: it must pick our spec by itself.
    """
    return {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": capacity_bytes, **(extra or {})},
    }


def offload_spec(model: str, config: dict[str, Any] | None, **kwargs: Any) -> EngineSpec:
    """An engine with the tiny device cache (``DEVICE_BLOCKS``) and, when given, an offload connector."""
    return EngineSpec(
        model=model,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=DEVICE_BLOCKS,
        kv_transfer_config=config,
        **kwargs,
    )


def process_memory(pid: int) -> dict[str, int]:
    """``/proc/<pid>/smaps_rollup`` in bytes (``Rss``, ``Pss``, ``Anonymous``, ...)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def fill_prompts(capacity_bytes: int, kv_bytes_per_block: int, seed: int = 4242) -> list[list[int]]:
    """Distinct prompts whose full blocks exceed ``capacity_bytes`` by a quarter (the host cache fills)."""
    import random

    rng = random.Random(seed)
    blocks = FILL_PROMPT_TOKENS // BLOCK_TOKENS
    count = -(-capacity_bytes * 5 // 4 // (kv_bytes_per_block * blocks))
    return [[rng.randrange(1, 500) for _ in range(FILL_PROMPT_TOKENS)] for _ in range(count)]


@dataclass(frozen=True)
class MemoryRow:
    """One connector's host memory against its configured capacity.

    Attributes:
        connector: the connector's name.
        capacity_bytes: ``cpu_bytes_to_use`` of the measured engine; ``floor_bytes`` that of its twin.
        rss_bytes / floor_rss_bytes / bare_rss_bytes: Rss after the fill, of the engine, its
            floor-capacity twin and the engine without a connector.
        fill_seconds: wall time of the fill on the measured engine.
    """

    connector: str
    capacity_bytes: int
    floor_bytes: int
    rss_bytes: int
    floor_rss_bytes: int
    bare_rss_bytes: int
    fill_seconds: float

    @property
    def host_bytes(self) -> int:
        """Rss the capacity added over the floor twin: the host cache itself."""
        return self.rss_bytes - self.floor_rss_bytes

    @property
    def ratio(self) -> float:
        """``host_bytes / (capacity - floor)``: at most 1 when the connector keeps to its budget."""
        return self.host_bytes / (self.capacity_bytes - self.floor_bytes)

    @property
    def over_bare_bytes(self) -> int:
        """Rss over the engine without a connector (host cache plus the connector's own overhead)."""
        return self.rss_bytes - self.bare_rss_bytes


def _filled(engine: Engine, prompts: Sequence[Sequence[int]], timeout_s: float) -> tuple[int, float]:
    start = time.monotonic()
    engine.generate([Prompt(token_ids=list(p), max_tokens=1) for p in prompts], timeout_s=timeout_s)
    seconds = time.monotonic() - start
    time.sleep(0.5)  # let background copy threads finish their last stores
    return process_memory(engine.pid)["Rss"], seconds


def measure_memory(
    host: EngineHost,
    model: str,
    connector: str,
    capacity_bytes: int,
    kv_bytes_per_block: int,
    *,
    engine: Engine | None = None,
    bare_rss_bytes: int,
    timeout_s: float = 600.0,
) -> MemoryRow:
    """Fill ``engine`` (or a fresh one) and its floor-capacity twin, read both engines' Rss.

    ``bare_rss_bytes``: Rss of an engine without a connector after the same fill (`bare_rss`).
    The twin is closed here; a given ``engine`` is left running, a fresh one is closed. Give an
    ``engine`` only with the same history as a fresh one: Rss also grows with past workloads.
    """
    prompts = fill_prompts(capacity_bytes, kv_bytes_per_block)
    own = engine is None
    measured = engine or host.spawn(offload_spec(model, offload_config(connector, capacity_bytes)), connector)
    try:
        rss, seconds = _filled(measured, prompts, timeout_s)
    finally:
        if own:
            measured.close()
    floor = kv_bytes_per_block
    twin = host.spawn(offload_spec(model, offload_config(connector, floor)), f"{connector}-floor")
    try:
        floor_rss, _ = _filled(twin, prompts, timeout_s)
    finally:
        twin.close()
    return MemoryRow(connector, capacity_bytes, floor, rss, floor_rss, bare_rss_bytes, seconds)


def bare_rss(engine: Engine, capacity_bytes: int, kv_bytes_per_block: int, timeout_s: float = 600.0) -> int:
    """Rss of an engine without a connector after the fill `measure_memory` gives the others."""
    return _filled(engine, fill_prompts(capacity_bytes, kv_bytes_per_block), timeout_s)[0]


def render_rows(rows: Sequence[MemoryRow]) -> str:
    """The README's table: one row per connector."""
    mib = 1 << 20
    lines = [
        "| connector | `cpu_bytes_to_use` | host Rss (capacity - floor twin) | ratio | Rss over no-connector engine |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.connector}` | {r.capacity_bytes / mib:.1f} MiB | {r.host_bytes / mib:.2f} MiB | "
            f"{r.ratio:.3f} | {r.over_bare_bytes / mib:.2f} MiB |"
        )
    return "\n".join(lines)


def kv_bytes_per_block(num_layers: int = 4, kv_heads: int = 2, head_dim: int = 32, dtype_bytes: int = 4) -> int:
    """Device KV bytes of one block of the tiny Llama (`model.write_tiny_llama`): K and V of every layer."""
    return num_layers * 2 * kv_heads * head_dim * BLOCK_TOKENS * dtype_bytes


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    """Measure every offload connector and print the table."""
    parser = argparse.ArgumentParser(prog="python -m ascend_dist.cli.engines.offload_bench", description=__doc__)
    parser.add_argument("--capacity-mib", type=float, default=32.0, help="cpu_bytes_to_use of each connector")
    parser.add_argument("--connector", action="append", choices=CONNECTORS, help="default: all three")
    args = parser.parse_args(argv)
    capacity = int(args.capacity_mib * (1 << 20))
    block = kv_bytes_per_block()
    with EngineHost(engine_python() or sys.executable) as host:
        model = str(host.write_model(Path(host.workdir) / "a" / "tiny", seed=1))
        bare = host.spawn(offload_spec(model, None), "no-connector")
        try:
            bare_bytes = bare_rss(bare, capacity, block)
        finally:
            bare.close()
        rows = [
            measure_memory(host, model, c, capacity, block, bare_rss_bytes=bare_bytes)
            for c in (args.connector or CONNECTORS)
        ]
    out(render_rows(rows))
    return 0 if all(r.ratio <= 1.0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
