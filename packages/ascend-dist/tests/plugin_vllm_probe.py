"""Run in a fresh process of the vLLM venv: load vLLM's general plugins as vLLM does, report registries.

`python plugin_vllm_probe.py [--preregister NAME] [--third-party NAME] [--resolve NAME ...]` prints one
JSON line. ``--third-party NAME`` stands for another plugin that already replaced vLLM's own entry for
NAME; ``--resolve`` names are looked up through vLLM's factory after plugin loading (``resolved``:
name -> ``module:class``, and ``by_module_path``: each name selected with vLLM's own module path).
"""

from __future__ import annotations

import json
import logging
import sys

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.plugins import load_general_plugins


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def main() -> None:
    capture = Capture()
    if "--logging" in sys.argv:  # nothing configured for ascend_dist: what a vLLM process gives it
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging

        load_general_plugins()
        configure_logging(LoggingConfig())  # as vLLM's processes do, here after the plugins loaded
        ours = logging.getLogger("ascend_dist.kv_mooncake.pull")
        ours.warning("a read failed")
        ours.info("a read took long")
        ours.debug("a debug detail")
        print(json.dumps({}))
        return
    logging.getLogger("ascend_dist").addHandler(capture)
    logging.getLogger("ascend_dist").setLevel(logging.DEBUG)
    if "--preregister" in sys.argv:
        name = sys.argv[sys.argv.index("--preregister") + 1]
        KVConnectorFactory.register_connector(name, "someone.else", "TheirConnector")
    if "--third-party" in sys.argv:  # another plugin that replaced vLLM's entry before us (vllm-ascend did)
        name = sys.argv[sys.argv.index("--third-party") + 1]
        del KVConnectorFactory._registry[name]
        KVConnectorFactory.register_connector(name, "someone.else", "TheirConnector")
    load_general_plugins()
    load_general_plugins()
    from ascend_dist.plugin import register, registered_names

    register()
    # Reading, never editing, vLLM's registries.
    seen = {
        "ours": sorted(registered_names()),
        "in_vllm": sorted(KVConnectorFactory._registry),
        "weight_engines": sorted(WeightTransferEngineFactory._registry),
        "trainer_engines": sorted(WeightTransferTrainerFactory._registry),
        "logs": capture.messages,
        "resolved": {},
        "by_module_path": {},
    }
    from vllm.distributed.eplb import eplb_communicator, eplb_state  # vLLM's EPLB, imported after the plugin

    from ascend_dist.plugin import startup_hooks

    seen["eplb_wrapped"] = [
        bool(getattr(eplb_communicator.create_eplb_communicator, "__ascend_dist_wrapped__", False)),
        bool(getattr(eplb_state.create_eplb_communicator, "__ascend_dist_wrapped__", False)),
        bool(getattr(eplb_state._move_to_workspace, "__ascend_dist_wrapped__", False)),
    ]
    seen["hooks_ran"] = startup_hooks.ran()
    import inspect

    seen["eplb_source_readable"] = "def create_eplb_communicator" in inspect.getsource(eplb_communicator)
    seen["eplb_state_source_readable"] = "class EplbState" in inspect.getsource(eplb_state)
    names = sys.argv[sys.argv.index("--resolve") + 1 :] if "--resolve" in sys.argv else []
    stock = {
        "OffloadingConnector": "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
        "SimpleCPUOffloadConnector": "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector",
    }
    for name in names:
        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both"))
        seen["resolved"][name] = f"{cls.__module__}:{cls.__qualname__}"
        if name in stock:  # the escape hatch to vLLM's own class
            config = KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_module_path=stock[name])
            cls = KVConnectorFactory.get_connector_class(config)
            seen["by_module_path"][name] = f"{cls.__module__}:{cls.__qualname__}"
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
