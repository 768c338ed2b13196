"""This node's defaults for ``host`` and ``mooncake_protocol`` when the config leaves them out.

Runs in: every connector's scheduler and worker processes, once per config parse (`core.config`).
A P instance whose ranks span nodes runs one config on every node, so its ``host`` cannot name a
node: each process advertises the address of the node it runs on. That address is, in order:

1. ``VLLM_HOST_IP`` (vLLM's own variable naming this node's address for its distributed setup);
2. the source address of this node's route to a public address (a UDP ``connect``: no packet is
   sent; the interface the default route uses);
3. the first IPv4 address of an up, non-loopback interface (a node with no default route, e.g. a
   private cluster network or a network namespace);
4. ``127.0.0.1``, with a warning: such a node can only pair with peers on itself.

Never a wildcard: a value like ``0.0.0.0`` is refused by the config's host check (it binds every
interface and advertises nothing reachable). The protocol follows the device runtime the project
selects (`ascend_dist.common.device.detect`): ``ascend`` with an Ascend NPU (torch_npu), ``rdma``
with a CUDA GPU, ``tcp`` otherwise. The probes are injectable so the choice is tested without the
hardware.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterable, Mapping

from ascend_dist.common.device.detect import BackendProbe, select_backend

__all__ = ["HOST_ENV", "device_protocol", "interface_addresses", "node_address", "route_address"]

logger = logging.getLogger(__name__)

HOST_ENV = "VLLM_HOST_IP"
"""The variable naming this node's address (vLLM's; operators of multi-node vLLM already set it)."""
_PROBES = (("8.8.8.8", socket.AF_INET), ("2001:4860:4860::8888", socket.AF_INET6))
_SIOCGIFADDR = 0x8915
_SIOCGIFFLAGS = 0x8913
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def route_address() -> str | None:
    """The source address this node's routing table picks for a public address (no packet is sent)."""
    for target, family in _PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 80))
                address = str(s.getsockname()[0])
        except OSError:  # no route (no default gateway, the family disabled)
            continue
        if not address.startswith("127.") and address not in ("::1", "0.0.0.0", "::"):
            return address
    return None


def _ioctl(sock: socket.socket, request: int, name: str) -> bytes:
    packed = struct.pack("256s", name.encode()[:15])
    return fcntl.ioctl(sock.fileno(), request, array.array("B", packed).tobytes())


def interface_addresses() -> list[str]:
    """IPv4 addresses of this node's up, non-loopback interfaces, in interface index order (Linux)."""
    out: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                flags = struct.unpack_from("H", _ioctl(s, _SIOCGIFFLAGS, name), 16)[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                out.append(socket.inet_ntoa(_ioctl(s, _SIOCGIFADDR, name)[20:24]))
            except OSError:  # no IPv4 address on it (or it vanished meanwhile)
                continue
    return out


def node_address(
    env: Mapping[str, str] | None = None,
    route: Callable[[], str | None] = route_address,
    interfaces: Callable[[], Iterable[str]] = interface_addresses,
) -> str:
    """This node's address for ``host`` when the config leaves it out (see the module for the order).

    The value of ``VLLM_HOST_IP`` is returned as given: the config's host check refuses a wildcard
    or malformed one, naming ``host``.
    """
    env = os.environ if env is None else env
    if given := env.get(HOST_ENV, "").strip():
        return given
    if found := route():
        return found
    for address in interfaces():
        return address
    logger.warning(
        "host is not set, %s is empty and this node has no non-loopback address: using 127.0.0.1 "
        "(only peers on this node can reach it); set host in kv_connector_extra_config",
        HOST_ENV,
    )
    return "127.0.0.1"


_PROTOCOLS = {"npu": "ascend", "cuda": "rdma", "cpu": "tcp"}


def device_protocol(env: Mapping[str, str] | None = None, probe: BackendProbe | None = None) -> str:
    """Mooncake's transport for this node's device runtime: ``ascend`` (NPU), ``rdma`` (CUDA), else ``tcp``.

    The runtime is the project's one choice of it (`ascend_dist.common.device.detect.select_backend`:
    ``ASCEND_DIST_DEVICE`` when set, else torch_npu with an NPU, then CUDA, then the CPU), so the
    transport and the device code of a process never disagree.
    """
    return _PROTOCOLS[select_backend(env, probe).name]
