import importlib.metadata
import subprocess
import sys

from ascend_dist import plugin


def test_entry_point_is_declared_and_resolves_to_register():
    eps = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "ascend_dist"]
    assert len(eps) == 1
    assert eps[0].load() is plugin.register


def test_register_without_vllm_is_a_quiet_no_op_and_reentrant():
    plugin.register()
    plugin.register()
    if not plugin._installed("vllm"):
        assert plugin.registered_names() == frozenset()


def test_register_imports_no_component_and_nothing_heavy():
    code = (
        "import sys; from ascend_dist.plugin import register; register(); "
        "ours = [m for m in sys.modules if m.startswith('ascend_dist.') and not m.startswith('ascend_dist.plugin')]; "
        "print(sorted(ours), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["[]", "False"]


def test_installed_looks_at_files_without_importing():
    assert plugin._installed("ascend_dist.plugin")
    assert plugin._installed("ascend_dist.cli.main")
    assert not plugin._installed("ascend_dist.no_such_member.module")
    assert not plugin._installed("no_such_top_level_module")


def test_every_component_names_a_known_factory_and_vllm_ascend_names_are_kept():
    assert all(c.factory in plugin.FACTORIES for c in plugin.COMPONENTS)
    names = {c.name for c in plugin.COMPONENTS}
    assert {"MooncakeConnectorV1", "AscendStoreConnector", "MooncakeConnectorStoreV1", "UCMConnector"} <= names
    assert {"RecomputeCPUOffloadConnector"} <= names
