"""What `ascend-dist doctor` says about listeners: every port a node opens, where it binds, who checks it.

Runs in: the `ascend-dist` command's process; it opens no socket and imports no member. The table is
the deployment's reference (kept true with docs/architecture.md and the README's "Security"
section). ``host`` and ``kv_port`` fill in the addresses when the operator passes the node's
``kv_connector_extra_config`` values (``doctor --host H --kv-port N``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ascend_dist.cli.probes import Finding
from ascend_dist.common.errors import ConfigError
from ascend_dist.common.secret import SECRET_ENV, SECRET_FILE_ENV, load_secret

__all__ = ["LISTENERS", "Listener", "probe_authentication", "probe_ports"]


@dataclass(frozen=True)
class Listener:
    """One listening socket some component opens."""

    component: str
    bind: str  # the address it binds; "{host}" is the configured host
    port: str  # the port, or the setting it comes from; "{kv_port}" is the configured base
    guarded: str  # what protects it beyond the firewall
    ours: bool = True  # False: a native library's socket, bound where it decides


LISTENERS = (
    Listener("kv-mooncake pull: P side channel (per P rank)", "{host}", "{kv_port} + rank offset", "frame MAC"),
    Listener("kv-mooncake push: D side channel (per D rank)", "{host}", "{kv_port} + rank offset", "frame MAC"),
    Listener("kv-mooncake SFA: D read channel (per D rank)", "{host}", "{kv_port} + dp_rank*tp + tp_rank", "frame MAC"),
    Listener("kv-store: pool lookup RPC (per DP)", "{host}", "lookup_rpc_port + dp_rank or OS-chosen", "frame MAC"),
    Listener("kv-store: mooncake_master (when we start it)", "where told (127.0.0.1 in demos)", "its --port", "none"),
    Listener("weight-transfer: TCPStore (trainer rank 0)", "master_address", "master_port", "none"),
    Listener(
        "Mooncake TransferEngine: RPC / handshake port",
        "0.0.0.0 (Mooncake 0.3.13 ignores the host)",
        "OS-chosen",
        "none: firewall it",
        ours=False,
    ),
    Listener(
        "Mooncake TransferEngine: TCP transport (raw registered memory)",
        "* (all IPv4 and IPv6 addresses)",
        "OS-chosen",
        "none: firewall it",
        ours=False,
    ),
)  # fmt: skip


def _secret_on() -> bool:
    try:
        return load_secret() is not None
    except ConfigError:
        return False


def probe_ports(host: str = "127.0.0.1", kv_port: int | None = None) -> list[Finding]:
    """One finding per listener: where it binds and what guards it (warn: a wildcard we cannot change)."""
    findings = []
    mac_on = _secret_on()
    for item in LISTENERS:
        bind = item.bind.format(host=host)
        port = item.port.format(kv_port=kv_port if kv_port is not None else "kv_port")
        guarded = item.guarded if mac_on or item.guarded != "frame MAC" else "nothing (frame MAC once a secret is set)"
        detail = f"{bind} port {port}; guarded by: {guarded}"
        if item.ours:
            findings.append(Finding(f"port: {item.component}", "ok", detail))
        else:
            fix = "firewall it to the P/D and pool hosts (Mooncake cannot be told to bind one address)"
            findings.append(Finding(f"port: {item.component}", "warn", detail, fix))
    return findings


def probe_authentication() -> Finding:
    """Whether this environment configures the deployment secret (and that it is usable)."""
    try:
        secret = load_secret()
    except ConfigError as exc:
        return Finding("frame authentication", "missing", str(exc), f"fix {SECRET_FILE_ENV} / {SECRET_ENV}", True)
    if secret is None:
        fix = f"`ascend-dist secret --write PATH`, then {SECRET_FILE_ENV}=PATH on every node"
        return Finding("frame authentication", "warn", "off: peers are not authenticated", fix)
    return Finding("frame authentication", "ok", "on: every side-channel frame carries a MAC")
