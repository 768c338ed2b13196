"""Every KV connector the plugin registers is built by vLLM's own factory, by name, in both roles.

Pinned vLLM 0.33.0, CPU. The names come from `ascend_dist.plugin.register()` (no module path in the
config), so this proves what an operator's ``--kv-transfer-config`` does: the name resolves to our
class, the scheduler- and worker-role objects construct from a real ``VllmConfig``, and shut down.
A connector whose backend is absent on this machine (UCM) must fail with its typed error instead.
Deeper lifecycles live in each member's own vLLM tests; this file keeps the registry honest: a name
added to the plugin without a case here fails `test_every_registered_connector_has_a_case`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(240)]
pytest.importorskip("vllm")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_minloglevel", "2")

from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig  # noqa: E402

from ascend_dist import plugin  # noqa: E402
from ascend_dist.common.errors import AscendDistError, ConfigError  # noqa: E402
from ascend_dist.testing import vllm_builders as vb  # noqa: E402
from ascend_dist.testing.ports import free_port  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@dataclass
class Env:
    """What cases need from the machine: a store master address (started lazily, once)."""

    start_master: Callable[[], str]
    _address: str | None = None

    def master(self) -> str:
        if self._address is None:
            self._address = self.start_master()
        return self._address


@dataclass(frozen=True)
class Case:
    """How to configure one registered connector and what constructing it must give."""

    roles: tuple[str, ...]
    extra: Callable[[Env], dict[str, Any]]
    required: str | None = None  # an extra-config key whose absence must be a ConfigError naming it
    required_match: str | None = None  # what that error names when not the key itself (a documented fallback)
    required_role: KVConnectorRole = KVConnectorRole.SCHEDULER  # the role that reads the key
    prefix_caching: bool = False
    unavailable: str | None = None  # "module:Error", the typed error expected where the backend is absent
    kv_port: bool = False
    bad_role: str | None = None  # a kv_role the connector refuses (with a ConfigError naming kv_role)


def _pd_extra(_: Env) -> dict[str, Any]:
    return {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}


def _sfa_extra(env: Env) -> dict[str, Any]:
    return {**_pd_extra(env), "transfer_backend": "mooncake"}


def _store_extra(env: Env) -> dict[str, Any]:
    store = {
        "master_server_address": env.master(), "protocol": "tcp",
        "global_segment_size": "16MB", "local_buffer_size": "4MB",
    }  # fmt: skip
    return {"backend": "mooncake", "store_config": store, "lookup_rpc_port": free_port()}


def _recompute_extra(_: Env) -> dict[str, Any]:
    return {"cpu_bytes_to_use": "64 KiB"}


def _native_extra(_: Env) -> dict[str, Any]:
    return {
        "spec_name": "NPUOffloadingSpec",
        "spec_module_path": "ascend_dist.kv_offload.vllm_native",
        "cpu_bytes_to_use": 1 << 20,
    }


def _multi_extra(env: Env) -> dict[str, Any]:
    child = {
        "kv_connector": "RecomputeCPUOffloadConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": _recompute_extra(env),
    }  # fmt: skip
    return {"connectors": [child]}


def _error_class(dotted: str) -> type[Exception]:
    module, _, name = dotted.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, AscendDistError)
    return cls


PD_ROLES = ("kv_producer", "kv_consumer")
# Without ``store_config`` the worker falls back to MOONCAKE_CONFIG_PATH, and names it when unset.
STORE_REQUIRED: dict[str, Any] = {
    "required": "store_config",
    "required_match": "MOONCAKE_CONFIG_PATH",
    "required_role": KVConnectorRole.WORKER,
}
CASES: dict[str, Case] = {
    "MooncakeConnectorV1": Case(PD_ROLES, _pd_extra, required="prefill", kv_port=True, bad_role="kv_both"),
    "MooncakeHybridConnector": Case(PD_ROLES, _pd_extra, required="prefill", kv_port=True, bad_role="kv_both"),
    "MooncakeLayerwiseConnector": Case(PD_ROLES, _pd_extra, required="prefill", kv_port=True, bad_role="kv_both"),
    "SfaRemoteD2HConnector": Case(PD_ROLES, _sfa_extra, required="prefill", kv_port=True, bad_role="kv_both"),
    "AscendStoreConnector": Case(("kv_both",), _store_extra, **STORE_REQUIRED),
    "MooncakeConnectorStoreV1": Case(("kv_both",), _store_extra, **STORE_REQUIRED),
    "RecomputeCPUOffloadConnector": Case(("kv_both",), _recompute_extra),
    "UCMConnector": Case(("kv_both",), lambda _: {}, unavailable="ascend_dist.kv_offload.vllm_ucm:UcmUnavailable"),
    "AscendOffloadingConnector": Case(("kv_both",), _native_extra, prefix_caching=True),
    "AscendSimpleCPUOffloadConnector": Case(("kv_both",), lambda _: {"cpu_bytes_to_use": 4096}, prefix_caching=True),
    # vllm-ascend's names for the same two (vLLM's own names, pointed at ours by the plugin)
    "OffloadingConnector": Case(("kv_both",), _native_extra, prefix_caching=True),
    "SimpleCPUOffloadConnector": Case(("kv_both",), lambda _: {"cpu_bytes_to_use": 4096}, prefix_caching=True),
    "AscendMultiConnector": Case(("kv_both",), _multi_extra, required="connectors"),
}


def _registered() -> dict[str, plugin.Component]:
    return {
        c.name: c
        for c in plugin.COMPONENTS + plugin.VLLM_NAME_OVERRIDES
        if c.factory == "kv_connector" and plugin._installed(c.module)
    }  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = vb.write_model_dir(tmp_path_factory.mktemp("tiny-llama"))
    plugin.register()
    return d


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    masters: list[Any] = []

    def start() -> str:
        from ascend_dist.kv_store.master_process import MasterProcess

        master = MasterProcess(lease_ttl_ms=200, log_path=tmp_path_factory.mktemp("master") / "master.log")
        master.start()
        masters.append(master)
        return master.address

    try:
        yield Env(start)
    finally:
        for master in masters:
            master.stop()


def _vllm_config(model_dir: Path, name: str, role: str, case: Case, extra: dict[str, Any]) -> VllmConfig:
    ktc = KVTransferConfig(
        kv_connector=name,
        kv_role=role,
        engine_id=f"{name}-{role}",
        kv_port=free_port() if case.kv_port else 14579,
        kv_connector_extra_config=extra,
    )
    return vb.cpu_vllm_config(model_dir, ktc, num_blocks=NUM_BLOCKS, enable_prefix_caching=case.prefix_caching)


def _kv_cache_config() -> KVCacheConfig:
    return vb.kv_cache_config([(LAYERS, vb.attention_spec(2, 16))], num_blocks=NUM_BLOCKS)


def test_every_registered_connector_has_a_case() -> None:
    assert set(_registered()) == set(CASES)


CONSTRUCT = [(name, role) for name, case in CASES.items() for role in case.roles]


@pytest.mark.parametrize(("name", "kv_role"), CONSTRUCT, ids=[f"{n}-{r}" for n, r in CONSTRUCT])
def test_the_factory_builds_it_by_name_in_both_roles(model_dir: Path, env: Env, name: str, kv_role: str) -> None:
    component = _registered().get(name)
    if component is None:
        pytest.skip(f"{name}: its member is not installed")
    case = CASES[name]
    config = _vllm_config(model_dir, name, kv_role, case, case.extra(env))
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config).__name__ == component.class_name  # type: ignore[arg-type]
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        if case.unavailable is not None:
            with pytest.raises(_error_class(case.unavailable)):
                KVConnectorFactory.create_connector(config, role, _kv_cache_config())
            continue
        connector = KVConnectorFactory.create_connector(config, role, _kv_cache_config())
        try:
            assert type(connector).__name__ == component.class_name
            assert connector.role == role
        finally:
            connector.shutdown()


REQUIRED = [name for name, case in CASES.items() if case.required is not None]


@pytest.mark.parametrize("name", REQUIRED)
def test_a_missing_required_key_is_a_config_error_naming_it(
    model_dir: Path, env: Env, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    if name not in _registered():
        pytest.skip(f"{name}: its member is not installed")
    case = CASES[name]
    extra = case.extra(env)
    assert case.required is not None
    del extra[case.required]
    config = _vllm_config(model_dir, name, case.roles[0], case, extra)
    with pytest.raises(ConfigError, match=case.required_match or case.required):
        KVConnectorFactory.create_connector(config, case.required_role, _kv_cache_config())


BAD_ROLE = [name for name, case in CASES.items() if case.bad_role is not None]


@pytest.mark.parametrize("name", BAD_ROLE)
def test_a_role_the_connector_does_not_support_is_a_config_error(model_dir: Path, env: Env, name: str) -> None:
    if name not in _registered():
        pytest.skip(f"{name}: its member is not installed")
    case = CASES[name]
    assert case.bad_role is not None
    config = _vllm_config(model_dir, name, case.bad_role, case, case.extra(env))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ConfigError, match="kv_role"):
            KVConnectorFactory.create_connector(config, role, _kv_cache_config())
