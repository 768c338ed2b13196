"""Network namespaces made by a test: one "host" per P or D, joined by veth links (helpers only).

A hub namespace (D's host) holds a bridge with ``10.213.0.1/24``; each further namespace (a P host)
gets one veth end ``eth0`` with ``10.213.0.<k+1>/24``, the other end a port of the bridge. The
addresses exist only inside these namespaces and their loopback stays down, so a transfer between
them crosses the veth link or fails: there is no 127.0.0.1 shortcut. `Hosts.close` deletes every
namespace (their links with them); the caller stops the processes inside first. Names carry the
test process's pid, so parallel runs never share one, and `Hosts.create` first deletes those left
by a run that was killed before its finalizer ran (pid gone).

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; `Hosts.create` raises `NetnsUnavailable`
naming the reason otherwise, and the tests skip with it.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from pathlib import Path

__all__ = ["SUBNET", "Hosts", "NetnsUnavailable", "rx_bytes"]

SUBNET = "10.213.0"
_SEQ = itertools.count()
_OURS = re.compile(r"adn(\d+)x\d+(?:d|p\d+)")  # names `Hosts` gives: adn<test pid>x<seq><role>


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, a sandbox refusing them)."""


def _ip(*args: str, timeout_s: float = 10.0) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed (rc={done.returncode}): {done.stderr.strip()}")


def _sweep_stale() -> None:
    """Delete namespaces an earlier, hard-killed test run made (our names, their pid gone)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=False)
    for line in listed.stdout.splitlines():
        name = line.split(" ", 1)[0]
        match = _OURS.fullmatch(name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10, check=False)


def rx_bytes(pid: int, interface: str) -> int:
    """Bytes received so far on ``interface`` of the network namespace process ``pid`` runs in.

    ``/proc/<pid>/net/dev`` shows that process's namespace: no subprocess, cheap enough to poll.
    """
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, sep, counters = line.partition(":")
        if sep and name.strip() == interface:
            return int(counters.split()[0])
    raise KeyError(f"no interface {interface!r} in the namespace of pid {pid}")


class Hosts:
    """A hub namespace (bridge ``br0``, ``SUBNET.1``) and spoke namespaces linked to it by veth pairs."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.names: list[str] = []
        self.addresses: dict[str, str] = {}

    @classmethod
    def create(cls, spokes: int) -> Hosts:
        """The hub and ``spokes`` linked namespaces; everything made so far is deleted on a failure.

        Raises:
            NetnsUnavailable: Not permitted or not possible here (the message says why).
        """
        if shutil.which("ip") is None:
            raise NetnsUnavailable("iproute2's `ip` is not installed")
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"`ip netns add` needs root (running as uid {os.geteuid()})")
        _sweep_stale()
        hosts = cls(f"adn{os.getpid()}x{next(_SEQ)}")
        try:
            hub = hosts._add("d")
            _ip("-n", hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", hub, "addr", "add", f"{SUBNET}.1/24", "dev", "br0")
            _ip("-n", hub, "link", "set", "br0", "up")
            hosts.addresses[hub] = f"{SUBNET}.1"
            for k in range(1, spokes + 1):
                ns = hosts._add(f"p{k}")
                port = f"vp{k}"
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", hub)
                _ip("-n", hub, "link", "set", port, "master", "br0")
                _ip("-n", hub, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{SUBNET}.{k + 1}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                hosts.addresses[ns] = f"{SUBNET}.{k + 1}"
        except BaseException:
            hosts.close()
            raise
        return hosts

    def _add(self, role: str) -> str:
        name = f"{self.prefix}{role}"
        _ip("netns", "add", name)
        self.names.append(name)
        return name

    @property
    def hub(self) -> str:
        """D's namespace."""
        return self.names[0]

    @property
    def spokes(self) -> list[str]:
        """The P namespaces, in order."""
        return self.names[1:]

    def launcher(self, ns: str) -> tuple[str, ...]:
        """The command prefix that runs a process inside ``ns``."""
        return ("ip", "netns", "exec", ns)

    def set_link(self, spoke: str, up: bool) -> None:
        """Take ``spoke``'s link to the hub down (a cut cable) or bring it back up."""
        _ip("-n", spoke, "link", "set", "eth0", "up" if up else "down")

    def loopback_up(self, ns: str) -> bool:
        """Whether ``ns``'s loopback is up (it never is: nothing may take a 127.0.0.1 shortcut)."""
        done = subprocess.run(
            ["ip", "-n", ns, "-o", "link", "show", "lo"], capture_output=True, text=True, timeout=10, check=True
        )
        return ",UP" in done.stdout or "<UP" in done.stdout

    def close(self) -> None:
        """Delete every namespace made (their veth links and the bridge go with them). Idempotent."""
        errors = []
        for name in reversed(self.names):
            done = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True, timeout=10, check=False)
            if done.returncode != 0:
                errors.append(f"{name}: {done.stderr.strip()}")
        self.names.clear()
        if errors:
            raise NetnsUnavailable(f"could not delete namespaces: {errors}")
