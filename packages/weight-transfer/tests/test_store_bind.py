"""The trainer's TCPStore listens on the given address only (issue 23.4), read from /proc/net/tcp*."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ascend_dist.common.errors import ConfigError
from ascend_dist.weight_transfer.collective import TransferGroup

from .conftest import free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp*")

_LISTEN = "0A"


def _listeners(port: int) -> list[str]:
    """Hex local addresses of every socket listening on ``port`` (IPv4 and IPv6 tables)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == _LISTEN:
                found.append(address)
    return found


def test_the_store_listens_on_the_given_address_only() -> None:
    port = free_port()
    group = TransferGroup.join("127.0.0.1", port, 0, 2, timeout_s=5.0, init_timeout_s=5.0)
    # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex); a wildcard would be 00000000 or ::.
    assert _listeners(port) == ["0100007F"]
    group.store.set("probe", b"1")  # control: the store itself works on that socket
    assert group.store.get("probe") == b"1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_wildcard_master_address_is_refused(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransferGroup.join(host, free_port(), 0, 2, timeout_s=5.0)
    assert info.value.field == "master_address"
