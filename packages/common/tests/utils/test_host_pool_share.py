"""`claim_host_pool`: the first claimer allocates, the second gets the same pool or a ConfigError naming the field."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ascend_dist.common.errors import ConfigError
from ascend_dist.common.host_pool_share import (
    HostPoolGeometry,
    TensorHostPool,
    claim_host_pool,
    held_host_pool,
    release_host_pool,
)

GEO = HostPoolGeometry(num_layers=2, num_blocks=4, block_size=16, token_bytes=(96, 32))
DEV = 5  # a device index no other test of this process claims


def _alloc(geo: HostPoolGeometry = GEO, calls: list[int] | None = None) -> TensorHostPool:
    if calls is not None:
        calls.append(1)
    rows = geo.num_blocks * geo.block_size
    return TensorHostPool(geo, [[torch.zeros(rows, w, dtype=torch.int8) for w in geo.token_bytes]] * geo.num_layers)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield
    while (pool := held_host_pool(DEV)) is not None:
        release_host_pool(DEV, pool)


def test_the_second_claimer_gets_the_first_ones_pool_until_both_release() -> None:
    calls: list[int] = []
    first = claim_host_pool(DEV, GEO, lambda: _alloc(calls=calls), "A")
    second = claim_host_pool(DEV, GEO, lambda: _alloc(calls=calls), "B")
    assert second is first and len(calls) == 1  # control: B's allocator was never called
    assert held_host_pool(DEV + 1) is None  # another device has its own (none yet)
    release_host_pool(DEV, first)
    assert held_host_pool(DEV) is first  # B still holds it
    release_host_pool(DEV, second)
    assert held_host_pool(DEV) is None
    assert claim_host_pool(DEV, GEO, lambda: _alloc(calls=calls), "C") is not first and len(calls) == 2


@pytest.mark.parametrize(
    ("field", "value"), [("num_layers", 3), ("num_blocks", 8), ("block_size", 32), ("token_bytes", (128,))]
)
def test_another_geometry_is_refused_naming_the_field_and_the_allocator(field: str, value: object) -> None:
    claim_host_pool(DEV, GEO, _alloc, "SparseOffloadManager")
    other = HostPoolGeometry(**{**GEO.__dict__, field: value})
    with pytest.raises(ConfigError, match=rf"host_pool\.{field}=.*SparseOffloadManager allocated on device {DEV}"):
        claim_host_pool(DEV, other, lambda: _alloc(other), "D")


def test_an_allocator_returning_the_wrong_shape_is_refused_and_nothing_is_held() -> None:
    bad = TensorHostPool(GEO, [[torch.zeros(64, 96, dtype=torch.int8), torch.zeros(64, 16, dtype=torch.int8)]] * 2)
    with pytest.raises(ConfigError, match=r"host_pool\.layers\[0\]\[1\]"):
        claim_host_pool(DEV, GEO, lambda: bad, "A")
    wide = TensorHostPool(GEO, [[torch.zeros(64, 96, dtype=torch.float16), torch.zeros(64, 32, dtype=torch.int8)]] * 2)
    with pytest.raises(ConfigError, match=r"host_pool\.layers\[0\]\[0\]"):
        claim_host_pool(DEV, GEO, lambda: wide, "A")
    strided = TensorHostPool(
        GEO, [[torch.zeros(96, 64, dtype=torch.int8).t(), torch.zeros(64, 32, dtype=torch.int8)]] * 2
    )
    with pytest.raises(ConfigError, match=r"stride"):
        claim_host_pool(DEV, GEO, lambda: strided, "A")
    assert held_host_pool(DEV) is None
