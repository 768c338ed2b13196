"""`ascend-dist doctor`: what is installed and usable here, with a fix for whatever is not."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict

from ascend_dist.cli import ascend_probes, ports, probes
from ascend_dist.cli.probes import Finding
from ascend_dist.cli.render import render_table, write_json

__all__ = ["default_probes", "run_doctor"]

Probe = Callable[[], "Finding | list[Finding]"]


def default_probes(host: str = "127.0.0.1", kv_port: int | None = None) -> list[Probe]:
    """The probes `doctor` runs, in report order (``host`` / ``kv_port`` fill in the port table)."""
    return [
        probes.probe_backend,
        probes.probe_torch,
        probes.probe_python_deps,
        probes.probe_libibverbs,
        probes.probe_mooncake,
        probes.probe_vllm,
        probes.probe_members,
        ascend_probes.probe_ascend,
        ports.probe_authentication,
        functools.partial(ports.probe_ports, host, kv_port),
    ]


def collect(probe_list: Sequence[Probe]) -> list[Finding]:
    """Run each probe; a probe that itself crashes becomes a finding instead of a traceback."""
    findings: list[Finding] = []
    for probe in probe_list:
        try:
            result = probe()
        except Exception as exc:  # doctor must report, never crash
            name = getattr(probe, "__name__", "probe").removeprefix("probe_")
            findings.append(Finding(name, "missing", f"probe crashed: {type(exc).__name__}: {exc}", required=True))
            continue
        findings.extend(result if isinstance(result, list) else [result])
    return findings


def run_doctor(
    *,
    json_path: str | None = None,
    probe_list: Sequence[Probe] | None = None,
    out: Callable[[str], None] = print,
    host: str = "127.0.0.1",
    kv_port: int | None = None,
) -> int:
    """Print the report; return 1 when a required part is missing, else 0."""
    findings = collect(default_probes(host, kv_port) if probe_list is None else probe_list)
    rows = [(f.part, f.status, f.detail, f.fix) for f in findings]
    out(render_table(("part", "status", "detail", "fix"), rows))
    blocking = [f.part for f in findings if f.blocking]
    out(f"\n{'NOT READY: missing ' + ', '.join(blocking) if blocking else 'ready'}")
    if json_path:
        write_json(json_path, {"ready": not blocking, "findings": [asdict(f) for f in findings]})
    return 1 if blocking else 0
