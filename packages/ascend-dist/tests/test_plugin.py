import importlib.metadata
import subprocess
import sys

from ascend_dist import plugin


def test_entry_point_is_declared_and_resolves_to_register():
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "ascend_dist"]
    assert len(eps) == 1
    assert eps[0].load() is plugin.register


def test_register_is_reentrant_and_registers_only_installed_connectors():
    plugin.register()
    plugin.register()
    installed = {name for name, module, _ in plugin.KV_CONNECTORS if plugin._installed(module)}
    assert plugin.registered_names() <= installed


def test_register_imports_nothing_heavy():
    code = (
        "import sys; from ascend_dist.plugin import register; register(); "
        "print('torch' in sys.modules, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_connector_names_are_vllm_ascends():
    names = {name for name, _, _ in plugin.KV_CONNECTORS}
    assert {"MooncakeConnectorV1", "MooncakeLayerwiseConnector", "AscendStoreConnector", "UCMConnector"} <= names
