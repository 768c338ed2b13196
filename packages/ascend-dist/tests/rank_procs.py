"""Run one script per rank as child processes and collect each rank's last JSON line (never pickle)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ascend_dist.testing.ports import free_port


def run_ranks(script: Path, world: int, *, timeout: float) -> list[dict[str, Any]]:
    """Start `python script RANK WORLD PORT` for every rank; all must exit 0. Returns their reports by rank."""
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]  # fmt: skip
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for rank, (p, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    return sorted(reports, key=lambda r: r["rank"])
