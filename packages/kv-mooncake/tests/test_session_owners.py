"""`SessionOwners`: which later owner of a Mooncake session name this process may still read."""

from __future__ import annotations

import pytest

from ascend_dist.kv_mooncake.core.session_owners import SESSION_OWNERS, SessionOwners, SessionReused, session_owners_for


def test_the_first_owner_is_read_again_and_again() -> None:
    owners = SessionOwners()
    owners.claim("10.0.0.1:15000", "10.0.0.1:15000#a", (15001,))
    owners.claim("10.0.0.1:15000", "10.0.0.1:15000#a", (15001,))
    assert len(owners) == 1


def test_a_new_owner_on_other_transport_ports_is_refused_naming_both() -> None:
    owners = SessionOwners()
    owners.claim("10.0.0.1:15000", "10.0.0.1:15000#a", (15001,))
    with pytest.raises(SessionReused, match=r"10\.0\.0\.1:15000#b on transport ports \[15002\].*#a on \[15001\]"):
        owners.claim("10.0.0.1:15000", "10.0.0.1:15000#b", (15002,))
    with pytest.raises(SessionReused):  # and stays refused: Mooncake still holds the first descriptor
        owners.claim("10.0.0.1:15000", "10.0.0.1:15000#b", (15002,))


def test_a_new_owner_on_the_same_transport_ports_is_read() -> None:
    owners = SessionOwners()
    owners.claim("10.0.0.1:15000", "10.0.0.1:15000#a", (15001,))
    owners.claim("10.0.0.1:15000", "10.0.0.1:15000#b", (15001,))  # Mooncake's old descriptor names its port


def test_sessions_are_apart() -> None:
    owners = SessionOwners()
    owners.claim("10.0.0.1:15000", "10.0.0.1:15000#a", (15001,))
    owners.claim("10.0.0.2:15000", "10.0.0.2:15000#b", (15002,))
    assert len(owners) == 2


def test_only_tcp_connectors_check_sessions() -> None:
    assert session_owners_for("tcp") is SESSION_OWNERS  # Mooncake TCP keeps a descriptor for good
    assert session_owners_for("rdma") is None and session_owners_for("ascend") is None
